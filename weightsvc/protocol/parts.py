"""A version made of parts held by several replicas (sharded replicas): where each part's bytes lie,
and the manifest of the whole."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from weightsvc.protocol.lag import pool_lag
from weightsvc.protocol.manifest import Manifest, Part, ServedTensor


@dataclass(frozen=True)
class Segment:
    """Bytes [start, start + nbytes) of a version's data section, held at `local` in a replica's data."""

    start: int
    local: int
    nbytes: int


def held_span(spans: Sequence[Segment], start: int, end: int) -> Segment | None:
    """The one of `spans` that holds the bytes [start, end) of the data section, if one does."""
    return next((s for s in spans if s.start <= start and end <= s.start + s.nbytes), None)


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
        adapter=first.adapter,
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
