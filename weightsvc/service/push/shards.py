"""How the shards that several learner ranks push combine into whole tensors.

Each rank of an FSDP or tensor-parallel learner declares, in its header, the tensors it holds and
for each one the flat element range it pushes (its shard); `Push` (pushes.py) gathers the ranks'
headers and merges their shards here (each tensor covered exactly once, shapes agreed).
"""

from __future__ import annotations

from collections.abc import Mapping

from weightsvc.errors import InvalidArgument
from weightsvc.protocol.manifest import TensorSpec

MAX_WORLD_SIZE = 1 << 16


def merge_shards(where: str, ranks: Mapping[int, tuple[TensorSpec, ...]]) -> tuple[TensorSpec, ...]:
    """The whole tensors that the ranks' shards make up, in order of first declaration (lowest rank
    first); raises if ranks disagree on a shape or the shards of a tensor leave a gap or overlap."""
    if len(ranks) == 1:  # one rank of whole tensors, each declared once: they are the version's
        (specs,) = ranks.values()
        if all(s.part is None for s in specs) and len({s.name for s in specs}) == len(specs):
            return specs
    whole: dict[str, TensorSpec] = {}
    shards_of: dict[str, list[tuple[int, int, int]]] = {}  # name -> (offset, count, rank)
    for rank in sorted(ranks):
        for spec in ranks[rank]:
            first = whole.setdefault(spec.name, TensorSpec(spec.name, spec.shape, spec.dtype))
            if first.shape != spec.shape:
                owner = shards_of[spec.name][0][2]
                raise InvalidArgument(
                    f"{where}: tensor {spec.name!r}: rank {owner} declares shape {list(first.shape)}, "
                    f"rank {rank} declares {list(spec.shape)}",
                    reason="invalid_header",
                )
            shards_of.setdefault(spec.name, []).append((*spec.elements, rank))
    for name, shards in shards_of.items():
        numel = whole[name].numel
        end, end_rank = 0, None
        for offset, count, rank in sorted(shards):
            if count == 0:
                continue
            if offset < end:
                raise InvalidArgument(
                    f"{where}: tensor {name!r}: the part of rank {rank} (elements [{offset}, {offset + count})) "
                    f"overlaps the part of rank {end_rank}, which ends at element {end}",
                    reason="invalid_header",
                )
            if offset > end:
                break
            end, end_rank = offset + count, rank
        if end != numel:
            missing_end = min([o for o, c, _ in shards if o > end and c] + [numel])
            raise InvalidArgument(
                f"{where}: tensor {name!r} of shape {list(whole[name].shape)}: no rank pushes elements "
                f"[{end}, {missing_end})",
                reason="invalid_header",
            )
    return tuple(whole.values())
