"""What a version is: its manifest, and the safetensors framing of its served bytes.

A committed version is one safetensors file: an 8-byte header length, a JSON header whose
`__metadata__` carries the manifest, then the data section with every served tensor back to back.
The same bytes are held in memory, written to the data dir, streamed over HTTP, and rebuilt by
clients that pulled over gRPC.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import struct
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import xxhash

from weightsvc.errors import DataLoss, InvalidArgument, ResourceExhausted

# safetensors dtype name -> bytes per element. Masters are F32; served copies are the rest.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1}
MASTER_DTYPE = "F32"
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Steps, so versions, are 0 ... MAX_STEP: each one can be asked for by number (18 digits), and a
# model at the last step can still take the pushes above it that int64 leaves room for.
MAX_STEP = 10**18 - 1
_VERSION = re.compile(r"[0-9]{1,18}")
METADATA_KEY = "weightsvc.manifest"
T = TypeVar("T")


def check_model_name(model: str) -> str:
    # Model names become file names and URL segments: keep them plain.
    if not _MODEL_NAME.fullmatch(model):
        raise InvalidArgument(
            f"model name {model!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            reason="invalid_header",
        )
    return model


def parse_version_ref(ref: str | int | None) -> int | None:
    """`None` for latest; a positive int for a version number."""
    if ref is None or ref == "" or ref == "latest":
        return None
    if isinstance(ref, int):
        return ref
    if _VERSION.fullmatch(ref):
        return int(ref)
    raise InvalidArgument(f"version {ref!r} is neither a version number nor 'latest'")


def checksum(data: Any) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def verify(name: str, data: Any, expected: str, *, where: str) -> None:
    got = checksum(data)
    if got != expected:
        raise DataLoss(f"{where}: tensor {name!r} checksum mismatch (got {got}, manifest says {expected})")


@dataclass(frozen=True)
class LagMetrics:
    churn: float
    update_visibility: float | None
    lag_steps: int
    relative_error: float
    saturated_elements: int
    sampled_elements: int
    exact: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def pool_lag(parts: list[LagMetrics | None]) -> LagMetrics | None:
    """The lag metrics of a version made of parts (sharded replicas), from each part's own: shares
    weighted by sampled elements, lag in steps the worst part's. Each replica samples its own tensors,
    so the pooled figures approximate, not equal, those of the same version committed whole."""
    known = [p for p in parts if p is not None and p.sampled_elements]
    if not known:
        return None
    total = sum(p.sampled_elements for p in known)
    visible = [(v, p.sampled_elements) for p in known if (v := p.update_visibility) is not None]

    def mean(values: list[tuple[float, int]]) -> float:
        weight = sum(w for _, w in values)
        return sum(v * w for v, w in values) / weight

    return LagMetrics(
        churn=mean([(p.churn, p.sampled_elements) for p in known]),
        update_visibility=mean(visible) if visible else None,
        lag_steps=max(p.lag_steps for p in known),
        relative_error=math.sqrt(mean([(p.relative_error**2, p.sampled_elements) for p in known])),
        saturated_elements=sum(p.saturated_elements for p in parts if p is not None),
        sampled_elements=total,
        exact=all(p.exact for p in known),
    )


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


DIGEST_BLOCK = 1 << 20


class MasterDigest:
    """Digest of one master tensor's bytes that does not depend on how they were chunked or split
    across learner ranks: xxh3-128 over the xxh3-128 of each aligned 1 MiB block. Pieces of a block
    that arrive separately (a rank boundary or an unaligned chunk inside it) are gathered first."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._blocks: dict[int, bytes] = {}
        self._partial: dict[int, tuple[bytearray, int]] = {}  # block -> (bytes so far, count filled)

    def update(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        pos, end = offset, offset + len(view)
        while pos < end:
            block = pos // DIGEST_BLOCK
            start = block * DIGEST_BLOCK
            stop = min(start + DIGEST_BLOCK, self.nbytes)
            piece = view[pos - offset : min(end, stop) - offset]
            if pos == start and len(piece) == stop - start:
                self._blocks[block] = xxhash.xxh3_128_digest(piece)
            else:
                entry = self._partial.pop(block, None)
                buf, filled = entry if entry is not None else (bytearray(stop - start), 0)
                buf[pos - start : pos - start + len(piece)] = piece
                filled += len(piece)
                if filled == len(buf):
                    self._blocks[block] = xxhash.xxh3_128_digest(buf)
                else:
                    self._partial[block] = (buf, filled)
            pos += len(piece)

    def hexdigest(self) -> str:
        count = -(-self.nbytes // DIGEST_BLOCK)
        assert len(self._blocks) == count and not self._partial, "digest of an incomplete tensor"
        return xxhash.xxh3_128_hexdigest(b"".join(self._blocks[i] for i in range(count)))


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
class Segment:
    """Bytes [start, start + nbytes) of a version's data section, held at `local` in a replica's data."""

    start: int
    local: int
    nbytes: int


def held_span(spans: Sequence[Segment], start: int, end: int) -> Segment | None:
    """The one of `spans` that holds the bytes [start, end) of the data section, if one does."""
    return next((s for s in spans if s.start <= start and end <= s.start + s.nbytes), None)


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
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        tensors = tuple(ServedTensor.from_dict(t) for t in d["tensors"])
        lag = LagMetrics(**d["lag"]) if d.get("lag") else None
        parts = tuple(Part.from_dict(p) for p in d.get("parts", ()))
        aliases = tuple(sorted(d.get("aliases", {}).items()))
        owners = tuple(d.get("owners", ()))
        return cls(**{**d, "tensors": tensors, "lag": lag, "parts": parts, "aliases": aliases, "owners": owners})

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
        key = separators[1]
        head = json.dumps(self.to_dict(tensors=False), separators=separators)
        body = separators[0].join(_tensor_json(self.tensors[i : i + JSON_SLICE], separators)
                                  for i in range(0, len(self.tensors), JSON_SLICE))
        empty = f'"tensors"{key}[]'  # (a string value cannot hold it: its quotes would be escaped)
        return head.replace(empty, f'"tensors"{key}[{body}]', 1)

    def safetensors_header(self, text: str | None = None) -> bytes:
        """The file prefix: little-endian u64 length + JSON header padded with spaces to 8 bytes.
        Made in slices of tensors, as `json` is; the same bytes as one `json.dumps` of the header.
        `text`: this manifest's `json()`, when the caller has made it already."""
        meta = json.dumps({"__metadata__": {METADATA_KEY: self.json() if text is None else text}},
                          separators=(",", ":"))
        entries = ",".join(_entries_json(self.tensors[i : i + JSON_SLICE])
                           for i in range(0, len(self.tensors), JSON_SLICE))
        raw = ("{" + meta[1:-1] + ("," + entries if entries else "") + "}").encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw


BIG_MANIFEST = 2000  # tensors: work on a manifest this size takes milliseconds, and goes off the loop
JSON_SLICE = 2000  # tensors per slice of JSON made at once (each holds the GIL for a few milliseconds)
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


_memos: dict[tuple[int, str], Any] = {}


async def in_thread(big: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`: in a worker thread when `big` (the event loop serves every transport and must
    never wait seconds on one push or pull), else inline (a thread costs more than small work)."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


async def off_loop(fn: Callable[..., T], m: Manifest, *args: Any) -> T:
    """`fn(m, *args)`, off the event loop for a big manifest."""
    return await in_thread(len(m.tensors) >= BIG_MANIFEST, fn, m, *args)


def memo(m: Manifest, kind: str, make: Callable[[Manifest], T]) -> T:
    """`make(m)`, computed once per manifest object and kind while the manifest lives: the encodings
    a transport sends of a version's manifest (a fleet pulls the same one; they cost 0.1-0.7 s at
    100,000 tensors). Safe from any thread (two first callers may both compute it)."""
    key = (id(m), kind)
    got = _memos.get(key)
    if got is None:
        got = _memos[key] = make(m)
        weakref.finalize(m, _memos.pop, key, None)
    return got  # type: ignore[no-any-return]


def combine_parts(parts: Mapping[str, Manifest], digest: str) -> Manifest:
    """The manifest of a version made of the replicas' parts: their tensors back to back in owner
    order, the combined master digest, and lag metrics pooled over parts. Parts follow each other
    without gaps (safetensors allows none), so a tensor after a part of odd size may sit unaligned in
    the file; torch and numpy read such tensors as they are."""
    owners = sorted(parts)
    first = parts[owners[0]]
    tensors: list[ServedTensor] = []
    placed: list[Part] = []
    offset = 0
    for owner, m, group, held in _groups(parts):
        placed.append(Part(owner, offset, group.nbytes if group else m.data_bytes, group.holders if group else ()))
        tensors += [replace(t, offset=t.offset - (group.offset if group else 0) + offset) for t in held]
        offset += placed[-1].nbytes
    return Manifest(
        model=first.model,
        version=first.version,
        format=first.format,
        rounding=first.rounding,
        seed=first.seed,
        committed_unix=max(m.committed_unix for m in parts.values()),
        data_bytes=offset,
        master_digest=digest,
        tensors=tuple(tensors),
        scaling=next((m.scaling for m in parts.values() if m.scaling), ""),
        lag=pool_lag([parts[o].lag for o in owners]),
        parts=tuple(placed),
        aliases=tuple(sorted({a for m in parts.values() for a in m.aliases})),
    )


def _groups(parts: Mapping[str, Manifest]) -> Iterator[tuple[str, Manifest, Part | None, Sequence[ServedTensor]]]:
    """What a version made of parts holds, in order: each owner's part (without replication), or each
    group of tensors (with it: sorted by holders, taken from the first one), with its tensors."""
    owners = sorted(parts)
    if not any(p.holders for o in owners for p in parts[o].parts):
        for o in owners:
            yield o, parts[o], None, parts[o].tensors
        return
    first: dict[tuple[str, ...], tuple[str, Part, Sequence[ServedTensor]]] = {}
    for o in owners:
        m, at = parts[o], 0
        for group in m.parts:
            first.setdefault(group.holders, (o, group, m.tensors[at : at + group.tensors]))
            at += group.tensors
    for holders in sorted(first):
        o, group, held = first[holders]
        yield o, parts[o], group, held


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


# The largest header safetensors readers take (the format's own limit): a version whose file header
# would be larger is refused before it commits, so that every committed version can be read back.
MAX_HEADER_BYTES = 100_000_000


def check_header_size(nbytes: int, where: str) -> None:
    if nbytes > MAX_HEADER_BYTES:
        raise ResourceExhausted(
            f"{where}: the version's file header would hold {nbytes} bytes (its tensors' names, shapes and "
            f"checksums), more than the {MAX_HEADER_BYTES} a safetensors header may: push fewer tensors or "
            "shorter names",
            reason="too_large",
        )


def read_safetensors_header(prefix: bytes) -> tuple[int, dict[str, Any]]:
    """(data section start, header dict) of a safetensors file given its first bytes."""
    if len(prefix) < 8:
        raise InvalidArgument("not a safetensors file: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or len(prefix) < 8 + n:
        raise InvalidArgument(f"not a safetensors file: header length {n} is out of range")
    return 8 + n, json.loads(prefix[8 : 8 + n])


def manifest_from_header(header: dict[str, Any]) -> Manifest:
    meta = header.get("__metadata__") or {}
    if METADATA_KEY not in meta:
        raise InvalidArgument("safetensors file carries no weightsvc manifest")
    return Manifest.from_dict(json.loads(meta[METADATA_KEY]))
