"""Which replica owns which tensor: rendezvous (highest random weight) hashing on tensor names.

Every client and server computes the same owner from the same list of replicas, with no table to
share. When a replica joins or leaves, only the tensors it comes to own or owned move; the others
stay where they are (their residuals and caches with them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

HASHING = "rendezvous-xxh64"


@dataclass(frozen=True, order=True)
class Replica:
    id: str
    grpc: str
    http: str


def _weight(replica_id: str, name: str) -> int:
    return xxhash.xxh64_intdigest(f"{replica_id}\0{name}".encode())


def owner(name: str, replicas: Sequence[Replica]) -> Replica:
    """The replica that owns tensor `name` (ties, vanishingly rare, go to the smaller id)."""
    if not replicas:
        raise ValueError("no replicas to own tensors")
    return max(replicas, key=lambda r: (_weight(r.id, name), [-ord(c) for c in r.id]))


def assign(names: Iterable[str], replicas: Sequence[Replica]) -> dict[str, list[str]]:
    """Tensor names per owning replica id, in the order given; replicas that own nothing are absent."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(owner(name, replicas).id, []).append(name)
    return out
