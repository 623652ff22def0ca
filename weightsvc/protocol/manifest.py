"""What a version is: its manifest, the tensors it serves, and the JSON both are written as.

A committed version is one safetensors file (`protocol.safetensors`): a JSON header whose
`__metadata__` carries the manifest, then the data section with every served tensor back to back.
The same bytes are held in memory, written to the data dir, streamed over HTTP, and rebuilt by
clients that pulled over gRPC.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import xxhash

from weightsvc.errors import DataLoss, InvalidArgument, ResourceExhausted, subject
from weightsvc.protocol.adapter import Adapter
from weightsvc.protocol.lag import LagMetrics
from weightsvc.protocol.refs import MAX_NAME_CHARS, MAX_STEP, RESERVED_NAME, check_model_name, check_tensor_name
from weightsvc.protocol.safetensors import framed

# safetensors dtype name -> bytes per element. Masters are F32; served copies are the rest.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1}
MASTER_DTYPE = "F32"
METADATA_KEY = "weightsvc.manifest"
T = TypeVar("T")


@dataclass(frozen=True)
class TensorSpec:
    """A master tensor as the learner declares it."""

    name: str
    shape: tuple[int, ...]
    dtype: str = MASTER_DTYPE
    # (offset, count): this rank pushes the flat elements [offset, offset + count); None: all of them.
    part: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def elements(self) -> tuple[int, int]:
        """The flat element range this spec pushes, as (offset, count)."""
        return self.part if self.part is not None else (0, self.numel)


@dataclass(frozen=True)
class Slice:
    """The index range [start, stop) along dimension `dim` of a served tensor: what a tensor-parallel
    worker pulls of a weight split over ranks (rows: dim 0, columns: dim 1)."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class ServedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # into the data section
    nbytes: int
    checksum: str = ""
    # In the manifest of a selection (a sliced pull): the slice of the version's tensor this is, its
    # shape the slice's. None: the whole tensor.
    slice: Slice | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form; `slice` only when set, so a version's header is what it was before slices.
        Written out field by field: a manifest may hold 100,000 tensors (`asdict` is 10x slower)."""
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "offset": self.offset,
             "nbytes": self.nbytes, "checksum": self.checksum}
        if self.slice is not None:
            d["slice"] = {"dim": self.slice.dim, "start": self.slice.start, "stop": self.slice.stop}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServedTensor:
        cut = d.get("slice")
        return cls(d["name"], tuple(d["shape"]), d["dtype"], d["offset"], d["nbytes"], d.get("checksum", ""),
                   Slice(**cut) if cut else None)


@dataclass(frozen=True)
class Part:
    """The bytes [offset, offset + nbytes) of a version's data section that one replica holds.

    With replication, a part is a group of tensors and `holders` are the replicas that hold it (any
    of them serves it; `owner` is the first); in a replica's own file, `offset` is where the group
    starts in that file and `tensors` how many of the file's tensors (in order) it holds."""

    owner: str
    offset: int
    nbytes: int
    holders: tuple[str, ...] = ()
    tensors: int = 0

    @property
    def sources(self) -> tuple[str, ...]:
        """The replicas that serve this part."""
        return self.holders or (self.owner,)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"owner": self.owner, "offset": self.offset, "nbytes": self.nbytes}
        if self.holders:  # (so a version without replication reads as it did before it)
            d |= {"holders": list(self.holders), "tensors": self.tensors}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Part:
        return cls(d["owner"], d["offset"], d["nbytes"], tuple(d.get("holders", ())), d.get("tensors", 0))


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    format: str
    rounding: str
    seed: int
    committed_unix: float
    data_bytes: int
    master_digest: str
    tensors: tuple[ServedTensor, ...] = field(default_factory=tuple)
    scaling: str = ""  # fp8 scale granularity when the version has fp8 tensors
    lag: LagMetrics | None = None  # computed at commit against the model's earlier versions
    # A version made of parts held by several replicas (sharded replicas), in owner order; empty: one
    # server holds all of it. A replica's own file holds its part alone, with one Part for itself.
    parts: tuple[Part, ...] = ()
    # Tied weights: (alias, tensor) pairs, sorted; the alias serves the tensor's bytes under its name.
    aliases: tuple[tuple[str, str], ...] = ()
    # A replica's own part: the owners of the push it is part of (its parts gather under them).
    owners: tuple[str, ...] = ()
    adapter: Adapter | None = None  # a version of a LoRA adapter: its base and PEFT config

    def to_dict(self, tensors: bool = True) -> dict[str, Any]:
        """JSON form; `tensors=False` leaves their list empty."""
        d = {"model": self.model, "version": self.version, "format": self.format, "rounding": self.rounding,
             "seed": self.seed, "committed_unix": self.committed_unix, "data_bytes": self.data_bytes,
             "master_digest": self.master_digest, "tensors": [t.to_dict() for t in self.tensors] if tensors else [],
             "scaling": self.scaling, "lag": None if self.lag is None else self.lag.to_dict(),
             "parts": [p.to_dict() for p in self.parts]}
        if self.aliases:  # (so the header of a version without ties is what it was before them)
            d["aliases"] = dict(self.aliases)
        if self.owners:
            d["owners"] = list(self.owners)
        if self.adapter is not None:
            d["adapter"] = self.adapter.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        tensors = tuple(ServedTensor.from_dict(t) for t in d["tensors"])
        lag = LagMetrics(**d["lag"]) if d.get("lag") else None
        parts = tuple(Part.from_dict(p) for p in d.get("parts", ()))
        aliases = tuple(sorted(d.get("aliases", {}).items()))
        owners = tuple(d.get("owners", ()))
        adapter = Adapter.from_dict(d["adapter"]) if d.get("adapter") else None
        return cls(**{**d, "tensors": tensors, "lag": lag, "parts": parts, "aliases": aliases, "owners": owners,
                      "adapter": adapter})

    def with_aliases(self, tensors: dict[str, T]) -> dict[str, T]:
        """`tensors` (by served name) with each alias added, as the very same object as its tensor."""
        for alias, target in self.aliases:
            if target in tensors:
                tensors[alias] = tensors[target]
        return tensors

    def info(self) -> dict[str, Any]:
        """The short form used in version lists and events."""
        return {
            "model": self.model,
            "version": self.version,
            "format": self.format,
            "rounding": self.rounding,
            "committed_unix": self.committed_unix,
            "tensor_count": len(self.tensors),
            "data_bytes": self.data_bytes,
            "lag": None if self.lag is None else self.lag.to_dict(),
        }

    def etag(self, header: bytes) -> str:
        """The HTTP entity tag of the version's file with this `header`: equal only where the bytes
        are (a relay serves a version of parts whole, under a header without them)."""
        return f'"{self.model}-{self.version}-{xxhash.xxh3_64_hexdigest(header)}"'

    def json(self, separators: tuple[str, str] = (", ", ": ")) -> str:
        """`json.dumps(self.to_dict())`, the same text, made in slices of tensors: one C call over
        100,000 tensors would hold the GIL, and so the event loop, for most of a second."""
        sep, key = separators
        head = json.dumps(self.to_dict(tensors=False), separators=separators)
        empty = f'"tensors"{key}[]'  # (a string value cannot hold it: its quotes would be escaped)
        before, after = head.split(empty, 1)
        # Joined once: each step over the whole text (~50 MB at 400,000 tensors: a join, a replace)
        # is one call that holds the GIL for 0.05-0.1 s.
        parts = [before, f'"tensors"{key}[']
        for i in range(0, len(self.tensors), JSON_SLICE):
            if i:
                parts.append(sep)
            parts.append(_tensor_json(self.tensors[i : i + JSON_SLICE], separators))
        return "".join([*parts, "]", after])

    def safetensors_header(self, text: str | None = None) -> bytes:
        """The file prefix: little-endian u64 length + JSON header padded with spaces to 8 bytes.
        Made in slices of tensors, as `json` is; the same bytes as one `json.dumps` of the header.
        `text`: this manifest's `json()`, when the caller has made it already."""
        text = self.json() if text is None else text
        # Each piece encoded on its own and the whole joined once: each step over the whole header
        # (~100 MB at 400,000 tensors: a concatenation, an encode) would hold the GIL for 0.1 s.
        # The text as a JSON string, escaped in slices too (escaping is per character).
        pieces = [f'{{"__metadata__":{{{_string(METADATA_KEY)}:"'.encode()]
        pieces += [_string(text[i : i + TEXT_SLICE])[1:-1].encode() for i in range(0, len(text), TEXT_SLICE)]
        pieces.append(b'"}')
        pieces += [b"," + _entries_json(self.tensors[i : i + JSON_SLICE]).encode()
                   for i in range(0, len(self.tensors), JSON_SLICE)]
        pieces.append(b"}")
        return framed(*pieces)


_OFFSET = operator.attrgetter("offset")
JSON_SLICE = 2000  # tensors per slice of JSON made at once (each holds the GIL for a few milliseconds)
TEXT_SLICE = 1 << 19  # characters of a manifest's text escaped at once, likewise
_string = json.encoder.encode_basestring_ascii  # a JSON string, as json.dumps writes it (in C)


def _tensor_json(tensors: Sequence[ServedTensor], separators: tuple[str, str]) -> str:
    """The JSON of `[t.to_dict() for t in tensors]` without its brackets: the text `json.dumps` makes,
    written directly (3x faster: the commit of 100,000 tensors waits on it)."""
    sep, key = separators
    out = []
    for t in tensors:
        if t.slice is not None:  # (a selection's manifest)
            out.append(json.dumps(t.to_dict(), separators=separators))
            continue
        shape = sep.join(map(str, t.shape))
        out.append(f'{{"name"{key}{_string(t.name)}{sep}"shape"{key}[{shape}]{sep}"dtype"{key}{_string(t.dtype)}'
                   f'{sep}"offset"{key}{t.offset}{sep}"nbytes"{key}{t.nbytes}{sep}"checksum"{key}'
                   f"{_string(t.checksum)}}}")
    return sep.join(out)


def _entries_json(tensors: Sequence[ServedTensor]) -> str:
    """The safetensors header entries of `tensors`, as `json.dumps` with (",", ":") writes them, without
    the braces."""
    return ",".join(
        f'{_string(t.name)}:{{"dtype":{_string(t.dtype)},"shape":[{",".join(map(str, t.shape))}],'
        f'"data_offsets":[{t.offset},{t.offset + t.nbytes}]}}'
        for t in tensors
    )


def layout(tensors: list[tuple[str, tuple[int, ...], str]], start: int = 0) -> tuple[list[ServedTensor], int]:
    """Place served tensors (name, shape, safetensors dtype) back to back from byte `start`; returns
    them and where they end. Wider dtypes go first (stable within a dtype) so every tensor is
    naturally aligned (from an aligned `start`)."""
    ordered = sorted(tensors, key=lambda t: -DTYPE_SIZES[t[2]])
    out, offset = [], start
    for name, shape, dtype in ordered:
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        out.append(ServedTensor(name, shape, dtype, offset, nbytes))
        offset += nbytes
    return out, offset


def check_manifest(m: Manifest, *, model: str | None = None, version: int | None = None,
                   max_bytes: int | None = None, max_tensors: int | None = None) -> Manifest:
    """`m`, a manifest that came from the network (a server's answer to a client, an upstream's to a
    relay), checked before anything is allocated, pulled or written by it: a model name that can be
    one, the `model` and `version` asked for (None: any), tensors with names, dtypes and shapes that
    can be, laid out back to back from byte 0 without gaps or overlaps (as safetensors requires), a
    `data_bytes` equal to what they take, aliases of its tensors and parts within its data section.

    DataLoss names the rule a manifest breaks (no weightsvc server commits one like it);
    ResourceExhausted a sound one larger than `max_bytes` (its data section) or `max_tensors`."""
    try:
        check_model_name(m.model if type(m.model) is str else repr(m.model))
    except InvalidArgument as e:
        raise DataLoss(f"the manifest the server sent is not one weightsvc makes: {e.message}") from None
    where = subject(m.model, m.version)
    bad = f"{where}: the manifest the server sent is not one weightsvc makes"
    if model is not None and m.model != model:
        raise DataLoss(f"{bad}: model {model!r} was asked for")
    if not (_is_int(m.version) and 0 <= m.version <= MAX_STEP):
        raise DataLoss(f"{bad}: versions are steps in [0, {MAX_STEP}]")
    if version is not None and m.version != version:
        raise DataLoss(f"{bad}: version {version} was asked for")
    if max_tensors is not None and len(m.tensors) > max_tensors:
        raise ResourceExhausted(f"{where}: {len(m.tensors)} tensors, more than the {max_tensors} taken here",
                                reason="too_large")
    if not _is_int(m.data_bytes) or m.data_bytes < 0:
        raise DataLoss(f"{bad}: data_bytes {m.data_bytes!r} is not a size")
    names = _tensor_names(m.tensors, bad)
    # Types and signs in bulk (100,000 tensors are checked in ~0.1 s), the rest tensor by tensor.
    numbers = [n for t in m.tensors for n in (t.offset, t.nbytes, *t.shape)]
    if {type(n) for n in numbers} - {int} or min(numbers, default=0) < 0:
        t = next(t for t in m.tensors if not all(type(n) is int and n >= 0 for n in (t.offset, t.nbytes, *t.shape)))
        raise DataLoss(f"{bad}: tensor {t.name!r} has offset {t.offset!r}, {t.nbytes!r} bytes and shape "
                       f"{list(t.shape)}: sizes are whole numbers ≥ 0")
    end = 0  # where the tensors placed so far end
    for t in sorted(m.tensors, key=_OFFSET):  # (in order already: the sort only checks it)
        size = DTYPE_SIZES.get(t.dtype, -1) * math.prod(t.shape) if type(t.dtype) is str else -1
        if t.nbytes != size:
            raise DataLoss(f"{bad}: tensor {t.name!r} has dtype {t.dtype!r}, shape {list(t.shape)} and {t.nbytes} "
                           f"bytes (known dtypes: {', '.join(DTYPE_SIZES)}; bytes as the shape takes)")
        if t.offset != end:
            raise DataLoss(f"{bad}: tensor {t.name!r} starts at byte {t.offset} of the data section, where the "
                           f"tensors before it end at {end}: tensors lie back to back, without gaps or overlaps")
        end += size
    if m.data_bytes != end:
        raise DataLoss(f"{bad}: data_bytes is {m.data_bytes}, and its {len(m.tensors)} tensors take {end}")
    if max_bytes is not None and m.data_bytes > max_bytes:
        raise ResourceExhausted(f"{where}: its data section of {m.data_bytes} bytes is more than the {max_bytes} "
                                "bytes taken here", reason="too_large")
    aliases: set[str] = set(names)
    for alias, target in m.aliases:
        try:
            check_tensor_name(bad, alias, aliases)
        except InvalidArgument as e:
            raise DataLoss(e.message) from None
        if target not in names:
            raise DataLoss(f"{bad}: alias {alias!r} is of {target!r}, not a tensor of the version")
    for p in m.parts:
        if not (_is_int(p.offset) and _is_int(p.nbytes) and 0 <= p.offset <= p.offset + p.nbytes <= m.data_bytes):
            raise DataLoss(f"{bad}: a part of replica {p.owner!r} lies at [{p.offset!r}, +{p.nbytes!r}), "
                           f"not within its data section of {m.data_bytes} bytes")
    return m


def _tensor_names(tensors: Sequence[ServedTensor], bad: str) -> set[str]:
    """The tensors' names, each checked (`check_tensor_name`: one by one only to name a bad one)."""
    names = [t.name for t in tensors]
    unique = set(names) if all(type(n) is str for n in names) else set()
    if (len(unique) == len(names) and RESERVED_NAME not in unique
            and all(0 < len(n) <= MAX_NAME_CHARS for n in names)):
        return unique
    seen: set[str] = set()
    for name in names:
        try:
            check_tensor_name(bad, name, seen)
        except InvalidArgument as e:
            raise DataLoss(e.message) from None
    raise AssertionError("unreachable")


def _is_int(n: object) -> bool:
    return type(n) is int  # (JSON's true and 1.0 are no sizes)


def manifest_from_header(header: dict[str, Any]) -> Manifest:
    meta = header.get("__metadata__") or {}
    if METADATA_KEY not in meta:
        raise InvalidArgument("safetensors file carries no weightsvc manifest")
    return Manifest.from_dict(json.loads(meta[METADATA_KEY]))
