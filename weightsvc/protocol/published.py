"""A learner rank's publish: its part of a served copy it exported itself, left in its own memory and
registered with its NIXL agent, as client and server share it (`Publish` in the proto; the JSON of
the HTTP route is the same fields).

The learner exports with the server's spec (the same rule and keys: bit for bit what a push of its
masters would serve), and declares per served tensor the whole tensor's shape and dtype, the flat
element range it holds, the checksum of its bytes and where they lie. The server READs them into a
version of its own and commits it (`service/copies`).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsvc.errors import InvalidArgument, subject
from weightsvc.protocol.fabric import MemoryRange
from weightsvc.protocol.lag import LagSums, WindowSums
from weightsvc.protocol.manifest import DTYPE_SIZES
from weightsvc.rounding import DEFAULT_FP8_PATTERN, ExportSpec
from weightsvc.v1 import weightsvc_pb2 as pb

MEMORY_KINDS = ("DRAM", "VRAM")
# One message carries a rank's request (gRPC's, or the HTTP route's JSON): a client refuses one over
# the server's default --max-message-bytes before it is sent (about 40,000 tensors with short names).
MAX_REQUEST_BYTES = 8 << 20


@dataclass(frozen=True)
class PublishedTensor:
    """A served tensor as one rank publishes it: the whole tensor's name, shape and dtype, and the
    part of it this rank holds (its checksum and the ranges its bytes lie in)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    part: tuple[int, int] | None  # (offset, count) of its flat elements; None: the whole tensor
    checksum: str
    ranges: tuple[MemoryRange, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def elements(self) -> tuple[int, int]:
        """The flat element range this rank holds, as (offset, count)."""
        return self.part if self.part is not None else (0, self.numel)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class RankPublish:
    """One learner rank's part of a published version."""

    model: str
    step: int
    rank: int
    world_size: int
    spec: ExportSpec
    agent: bytes  # the rank's NIXL agent metadata
    memory: str  # "DRAM" or "VRAM"
    tensors: tuple[PublishedTensor, ...]
    master_digest: str = ""
    aliases: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (alias, tensor), sorted
    lag: LagSums | None = None  # the lag figures of its rows (None: none sent)

    @property
    def where(self) -> str:
        return subject(self.model, step=self.step, rank=self.rank)

    @property
    def nbytes(self) -> int:
        """The bytes this rank publishes."""
        return sum(t.elements[1] * t.itemsize for t in self.tensors)

    def check(self) -> None:
        """INVALID_ARGUMENT naming the first field of its own that is not one (what needs no other rank
        and no server to tell): a dtype, a part outside its tensor, ranges that are not its bytes."""
        where = self.where
        if self.memory not in MEMORY_KINDS:
            raise InvalidArgument(f"{where}: memory {self.memory!r} is not one of {list(MEMORY_KINDS)}",
                                  reason="invalid_header")
        for t in self.tensors:
            what = subject(self.model, step=self.step, tensor=t.name, rank=self.rank)
            if t.dtype not in DTYPE_SIZES:
                raise InvalidArgument(f"{what}: unknown dtype {t.dtype!r} (known: {', '.join(DTYPE_SIZES)})",
                                      reason="invalid_header")
            if any(d < 0 for d in t.shape):
                raise InvalidArgument(f"{what}: a negative dimension in shape {list(t.shape)}", reason="invalid_header")
            offset, count = t.elements
            if offset < 0 or count < 0 or offset + count > t.numel:
                raise InvalidArgument(f"{what}: elements [{offset}, {offset + count}) are not within its shape "
                                      f"{list(t.shape)} ({t.numel} elements)", reason="invalid_header")
            if sum(r.nbytes for r in t.ranges) != count * t.itemsize or any(r.nbytes <= 0 for r in t.ranges):
                raise InvalidArgument(f"{what}: its memory ranges hold {sum(r.nbytes for r in t.ranges)} bytes, "
                                      f"its {count} elements of {t.dtype} take {count * t.itemsize}",
                                      reason="invalid_header")
            if not t.checksum:
                raise InvalidArgument(f"{what}: no checksum of its bytes", reason="invalid_header")
        problem = None if self.lag is None else self.lag.problem()
        if problem:
            raise InvalidArgument(f"{where}: its lag sums are not those of any rows: {problem}",
                                  reason="invalid_header")


def spec_to_proto(spec: ExportSpec) -> pb.ExportSpec:
    return pb.ExportSpec(format=spec.format, rounding=spec.rounding, seed=spec.seed, scaling=spec.scaling,
                         fp8_pattern=spec.fp8_pattern)


def _spec(fields: Mapping[str, Any], where: str) -> ExportSpec:
    try:
        return ExportSpec(str(fields["format"]), str(fields["rounding"]), int(fields["seed"]),
                          str(fields["scaling"] or "block"), str(fields["fp8_pattern"] or DEFAULT_FP8_PATTERN))
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgument(f"{where}: the export spec is not one: {e}", reason="invalid_header") from None


def publish_to_proto(p: RankPublish) -> pb.PublishRequest:
    return pb.PublishRequest(
        model=p.model, step=p.step, rank=p.rank, world_size=p.world_size, spec=spec_to_proto(p.spec), agent=p.agent,
        memory=p.memory, master_digest=p.master_digest, aliases=dict(p.aliases),
        lag=None if p.lag is None else lag_to_proto(p.lag),
        tensors=[pb.PublishedTensor(
            name=t.name, shape=list(t.shape), dtype=t.dtype,
            part=None if t.part is None else pb.TensorPart(offset=t.part[0], count=t.part[1]),
            checksum=t.checksum, ranges=[pb.MemoryRange(addr=r.addr, nbytes=r.nbytes, device=r.device)
                                         for r in t.ranges])
            for t in p.tensors])


def publish_from_proto(m: pb.PublishRequest) -> RankPublish:
    where = subject(m.model, step=m.step, rank=m.rank)
    s = m.spec
    spec = _spec({"format": s.format, "rounding": s.rounding, "seed": s.seed, "scaling": s.scaling,
                  "fp8_pattern": s.fp8_pattern}, where)
    tensors = tuple(
        PublishedTensor(t.name, tuple(t.shape), t.dtype, (t.part.offset, t.part.count) if t.HasField("part") else None,
                        t.checksum, tuple(MemoryRange(r.addr, r.nbytes, r.device) for r in t.ranges))
        for t in m.tensors)
    return RankPublish(m.model, m.step, m.rank, m.world_size or 1, spec, m.agent, m.memory, tensors,
                       m.master_digest, tuple(sorted(m.aliases.items())),
                       lag_from_proto(m.lag) if m.HasField("lag") else None)


def lag_to_proto(s: LagSums) -> pb.LagSums:
    return pb.LagSums(
        reference=s.reference, previous=s.previous, distance_sq=s.distance_sq, progress=s.progress,
        master_sq=s.master_sq, error_sq=s.error_sq, changed=s.changed, compared=s.compared,
        windows=[pb.VisibilityWindow(start=w.start, served_step=w.served_step, master_step=w.master_step,
                                     noise=w.noise, noise_sq=w.noise_sq) for w in s.windows],
        saturated_elements=s.saturated, sampled_elements=s.sampled, exact=s.exact)


def lag_from_proto(m: pb.LagSums) -> LagSums:
    return LagSums(
        m.reference, m.previous if m.HasField("previous") else None, m.distance_sq, m.progress, m.master_sq,
        m.error_sq, m.changed, m.compared,
        tuple(WindowSums(w.start, w.served_step, w.master_step, w.noise, w.noise_sq) for w in m.windows),
        m.saturated_elements, m.sampled_elements, m.exact)


def publish_from_dict(model: str, step: int, d: Any) -> RankPublish:
    """A rank's publish from the HTTP route's JSON body (the proto's fields; `agent` in base64)."""
    where = subject(model, step=step)
    try:
        if not isinstance(d, dict):
            raise TypeError("the body is not a JSON object")
        rank = int(d.get("rank", 0))
        where = subject(model, step=step, rank=rank)
        spec = _spec(d["spec"], where)
        tensors = []
        for t in d["tensors"]:
            part = t.get("part")
            tensors.append(PublishedTensor(
                str(t["name"]), tuple(int(x) for x in t["shape"]), str(t["dtype"]),
                None if part is None else (int(part["offset"]), int(part["count"])), str(t["checksum"]),
                tuple(MemoryRange(int(r[0]), int(r[1]), int(r[2])) for r in t.get("ranges", ()))))
        aliases = d.get("aliases") or {}
        if not isinstance(aliases, dict):
            raise TypeError("aliases is not an object")
        lag = d.get("lag")
        return RankPublish(model, step, rank, int(d.get("world_size") or 1), spec,
                           base64.b64decode(d["agent"], validate=True), str(d["memory"]), tuple(tensors),
                           str(d.get("master_digest", "")), tuple(sorted((str(a), str(b)) for a, b in aliases.items())),
                           None if lag is None else LagSums.from_dict(lag))
    except InvalidArgument:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise InvalidArgument(f"{where}: the publish request is not one: {type(e).__name__}: {e}",
                              reason="invalid_header") from None


def publish_to_dict(p: RankPublish) -> dict[str, Any]:
    """The HTTP route's JSON body (model and step are in its path)."""
    return {
        "rank": p.rank, "world_size": p.world_size,
        "spec": {"format": p.spec.format, "rounding": p.spec.rounding, "seed": p.spec.seed,
                 "scaling": p.spec.scaling, "fp8_pattern": p.spec.fp8_pattern},
        "agent": base64.b64encode(p.agent).decode(), "memory": p.memory, "master_digest": p.master_digest,
        "aliases": dict(p.aliases), **({} if p.lag is None else {"lag": p.lag.to_dict()}),
        "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                     "part": None if t.part is None else {"offset": t.part[0], "count": t.part[1]},
                     "checksum": t.checksum, "ranges": [list(r) for r in t.ranges]} for t in p.tensors],
    }
