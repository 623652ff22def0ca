"""Which replicas own which tensor: rendezvous (highest random weight) hashing on tensor names
(on the fused layer's name for the tensors an engine fuses: `fused_group`).

Every client and server computes the same owners from the same list of replicas, with no table to
share. With replication R, a tensor's owners are the R replicas of highest weight for its name, so
when a replica leaves, each of its tensors still has R - 1 owners and gains the next one; the others
stay where they are (their residuals and caches with them). The tensors with the same owners form a
group: every owner of a group holds its tensors in the same order, so any of them serves its bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from weightsvc.rounding import fused_group

HASHING = "rendezvous-xxh64"


@dataclass(frozen=True, order=True)
class Replica:
    id: str
    grpc: str
    http: str


# A replica that has not renewed its registration for this long is gone: the registry forgets it,
# and a learner leaves one it cannot reach out of its pushes for as long.
REPLICA_TTL_S = 15.0


def _weight(replica_id: str, name: str) -> int:
    return xxhash.xxh64_intdigest(f"{replica_id}\0{name}".encode())


Group = tuple[str, ...]  # the ids of a tensor's owners, sorted


def owners(name: str, replica_ids: Sequence[str], replication: int) -> Group:
    """The ids of the `replication` replicas that own tensor `name` (all of them if there are fewer),
    sorted. Ties of weight, vanishingly rare, go to the smaller id."""
    if not replica_ids:
        raise ValueError("no replicas to own tensors")
    key = fused_group(name)  # (a fused layer's tensors together)
    top = sorted(replica_ids, key=lambda r: (-_weight(r, key), r))[: max(1, replication)]
    return tuple(sorted(top))


def groups(names: Iterable[str], replica_ids: Sequence[str], replication: int) -> dict[str, Group]:
    """Each tensor's owners."""
    ids = sorted(replica_ids)
    return {name: owners(name, ids, replication) for name in names}


def assign(names: Iterable[str], replicas: Sequence[Replica], replication: int = 1) -> dict[str, list[str]]:
    """Tensor names per owning replica id, in the order given; replicas that own nothing are absent."""
    out: dict[str, list[str]] = {}
    for name, group in groups(names, [r.id for r in replicas], replication).items():
        for rid in group:
            out.setdefault(rid, []).append(name)
    return out
