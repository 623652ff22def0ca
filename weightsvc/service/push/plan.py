"""A push's layout plan: where each tensor is served in the version's data section, and which bytes
of it each learner rank's shard brings.

Pure and linear in the tensors (run off the loop for a big header). The plan is made once every
rank's header is in; the staging session (staging.py) fills it as the chunks arrive, and the export
jobs (export.py) write into the slots it laid out.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from weightsvc import rounding
from weightsvc.errors import InvalidArgument
from weightsvc.protocol import topology
from weightsvc.protocol.digest import MasterDigest, StreamedChecksum, checksum, masters_digest
from weightsvc.protocol.manifest import DTYPE_SIZES, MASTER_DTYPE, Manifest, Part, ServedTensor, TensorSpec, layout
from weightsvc.protocol.topology import Group
from weightsvc.service.push.messages import PushHeader

MASTER_ITEMSIZE = DTYPE_SIZES[MASTER_DTYPE]
# Room in a staged file's header beyond the manifest known at the start (its lag metrics and, on a
# sharded replica, its part come at commit). A header that still does not fit is written with a copy.
HEADER_SLACK = 4096


class PushedTensor:
    """One tensor of a push: its served slots, what has arrived of it, and what its export found."""

    def __init__(self, spec: TensorSpec, fmt: rounding.Format, slots: Sequence[ServedTensor]):
        self.spec = spec
        self.fmt = fmt
        self.slot = slots[0]  # the served elements
        self.scales = tuple(slots[1:])  # a scaled format's scale tensors (`rounding.served_tensors`)
        # NVFP4: the tensors an engine fuses with this one (itself included), which share its global
        # scale: exported together, once all of them are here.
        self.fused: Fused | None = None
        self.nbytes = spec.numel * DTYPE_SIZES[spec.dtype]
        self.received = 0  # bytes accepted on the loop, from all ranks
        # Filled by the export worker, chunk by chunk, in arrival order:
        self.exported = 0  # bytes exported (bf16/fp16) or gathered (scaled formats)
        self.master: np.ndarray | None = None  # scaled formats: scales need the whole tensor first
        self.new_residual: np.ndarray | None = None  # ef: this version's residual
        self.master_digest = MasterDigest(self.nbytes)
        self.nonfinite = 0
        self.saturated = 0
        self.checksums: dict[str, str] = {}
        self.served_checksum = StreamedChecksum()  # bf16/fp16: of the slot, as its chunks are exported
        # first element of a chunk -> its sampled (master, served, bits)
        self.samples: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


class Fused:
    """The tensors of a push that share NVFP4's global scale (`rounding.fused_group`)."""

    def __init__(self) -> None:
        self.members: list[PushedTensor] = []
        self.started = False

    def ready(self) -> bool:
        return not self.started and all(t.received == t.nbytes for t in self.members)


class RankShard:
    """A learner rank's shard of a tensor: the bytes [start, end) it pushes, in order."""

    def __init__(self, tensor: PushedTensor, start: int, end: int) -> None:
        self.tensor = tensor
        self.start = start
        self.end = end
        self.received = start


def served_manifest(header: PushHeader, spec: rounding.ExportSpec, slots: Iterable[ServedTensor], data_bytes: int,
                    scaled: bool, checksums: Mapping[str, str], master_digest: str,
                    segments: tuple[Part, ...] = ()) -> Manifest:
    """The manifest of the version a push stages, less its lag metrics (the commit adds them)."""
    ordered = sorted(slots, key=lambda s: s.offset)
    return Manifest(
        model=header.model,
        version=header.step,
        format=spec.format,
        rounding=spec.rounding,
        seed=spec.seed,
        committed_unix=time.time(),
        data_bytes=data_bytes,
        master_digest=master_digest,
        tensors=tuple(ServedTensor(s.name, s.shape, s.dtype, s.offset, s.nbytes, checksums[s.name]) for s in ordered),
        scaling=spec.scaling if scaled else "",
        parts=segments,
        aliases=header.aliases,
        owners=tuple(sorted(header.owners)),
        adapter=header.adapter,
    )


@dataclasses.dataclass
class Plan:
    """Where each tensor of a push is served: its format, its slot in the data section, and the shard
    each rank pushes of it."""

    tensors: dict[str, PushedTensor]
    shards: dict[int, dict[str, RankShard]]  # rank -> tensor name -> that rank's shard
    data_bytes: int
    slots: list[ServedTensor]
    numel: int  # elements of all the masters
    empty: list[PushedTensor]  # the tensors without elements
    # Replicated sharded replicas: the groups of tensors this replica holds, one after the other in
    # the data section, each laid out as every other owner of the group lays it out.
    segments: tuple[Part, ...] = ()
    groups: dict[str, Group] = dataclasses.field(default_factory=dict)  # each tensor's owners


def make_plan(header: PushHeader, spec: rounding.ExportSpec, ranks: Mapping[int, tuple[TensorSpec, ...]],
              where: str, replica: str = "") -> Plan:
    """The plan of the push whose whole tensors `header` declares, `ranks` holding each rank's shards
    (pure, linear in its tensors: run off the loop for a big header)."""
    declared = {t.name for t in header.tensors}
    if header.adapter is not None:
        header.adapter.check(where, ((t.name, t.shape) for t in header.tensors), whole=not header.owners)
    aliases_of: dict[str, tuple[str, ...]] = {}
    for alias, target in header.aliases:
        if target not in declared:
            raise InvalidArgument(f"{where}: alias {alias!r} names tensor {target!r}, which the push does "
                                  "not declare", reason="invalid_header")
        aliases_of[target] = (*aliases_of.get(target, ()), alias)
    entries, fmts = [], {}
    base_of: dict[str, str] = {}  # each served tensor's master
    place: dict[str, int] = {}  # its place among its master's served tensors (elements, then scales)
    for t in header.tensors:
        fmt = fmts[t.name] = spec.format_for(t.name, t.shape, aliases_of.get(t.name, ()))
        for i, served in enumerate(rounding.served_tensors(t.name, t.shape, fmt, spec.scaling)):
            entries.append(served)
            base_of[served[0]], place[served[0]] = t.name, i
    if len(base_of) < len(entries):
        names = collections.Counter(name for name, _, _ in entries)
        clash = next(name for name, count in names.items() if count > 1)
        raise InvalidArgument(f"{where}: tensor {clash!r} clashes with a served tensor of another (its scales "
                              "or packed elements)", reason="invalid_header")
    segments: tuple[Part, ...] = ()
    of = topology.groups([t.name for t in header.tensors], header.owners, header.replication) if header.owners else {}
    if header.owners and header.replication > 1:
        slots_list, data_bytes, segments = _grouped(entries, base_of, of, replica, where)
    else:
        slots_list, data_bytes = layout(entries)
    slots: dict[str, list[ServedTensor]] = {}
    for slot in slots_list:
        slots.setdefault(base_of[slot.name], []).append(slot)
    tensors = {t.name: PushedTensor(t, fmts[t.name], sorted(slots[t.name], key=lambda slot: place[slot.name]))
               for t in header.tensors}
    fused: dict[str, Fused] = {}
    for pushed in tensors.values():
        if pushed.fmt.global_scale:
            pushed.fused = fused.setdefault(rounding.fused_group(pushed.spec.name), Fused())
            pushed.fused.members.append(pushed)
    shards = {
        rank: {s.name: RankShard(tensors[s.name], s.elements[0] * MASTER_ITEMSIZE, sum(s.elements) * MASTER_ITEMSIZE)
               for s in specs}
        for rank, specs in ranks.items()
    }
    return Plan(tensors, shards, data_bytes, slots_list, sum(t.spec.numel for t in tensors.values()),
                [t for t in tensors.values() if t.nbytes == 0], segments, of)


def _grouped(entries: list[tuple[str, tuple[int, ...], str]], base_of: Mapping[str, str], of: dict[str, Group],
             replica: str, where: str) -> tuple[list[ServedTensor], int, tuple[Part, ...]]:
    """The layout of a replicated part (`of`: each tensor's owners): its tensors by group (sorted by
    owners), each group's by name, so that every owner of a group places its bytes the same way."""
    by_group: dict[Group, list[tuple[str, tuple[int, ...], str]]] = {}
    for entry in entries:
        base = base_of[entry[0]]  # (the master tensor of a scale or of packed elements)
        group = of[base]
        if replica and replica not in group:
            raise InvalidArgument(f"{where}: tensor {base!r} belongs to replicas {list(group)}, not to this one "
                                  f"({replica!r}); push each tensor to its owners (GetTopology)",
                                  reason="invalid_header")
        by_group.setdefault(group, []).append(entry)
    slots: list[ServedTensor] = []
    segments: list[Part] = []
    offset = 0
    for group in sorted(by_group):
        placed, end = layout(sorted(by_group[group]), offset)
        slots += placed
        segments.append(Part(replica, offset, end - offset, group, len(placed)))
        offset = end
    return slots, offset, tuple(segments)


def header_room(header: PushHeader, spec: rounding.ExportSpec, plan: Plan) -> int:
    """Bytes to leave for the file header in front of a staged version's data: that of the manifest
    as far as it is known (every checksum as long as a real one), and room for what the commit adds."""
    blank = checksum(b"")
    scaled = any(t.scales for t in plan.tensors.values())
    sized = served_manifest(header, spec, plan.slots, plan.data_bytes, scaled, {s.name: blank for s in plan.slots},
                            "xxh3_128:" + "0" * 32, plan.segments)
    return len(sized.safetensors_header()) + HEADER_SLACK


def exported_manifest(header: PushHeader, spec: rounding.ExportSpec, plan: Plan) -> Manifest:
    """The manifest of the version once its tensors are exported: their checksums, and the digest of
    the master (order-independent: names, shapes and fp32 bytes)."""
    tensors = plan.tensors
    digest = masters_digest(((t.spec.name, t.spec.shape, t.master_digest.hexdigest()) for t in tensors.values()),
                            header.aliases)
    checksums = {n: c for t in tensors.values() for n, c in t.checksums.items()}
    slots = [s for t in tensors.values() for s in (t.slot, *t.scales)]
    scaled = any(t.scales for t in tensors.values())
    return served_manifest(header, spec, slots, plan.data_bytes, scaled, checksums, digest,
                           plan.segments)
