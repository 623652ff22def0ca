"""Rendezvous hashing of tensor names onto replicas."""

from __future__ import annotations

import random

import pytest

from weightsvc.core.topology import Replica, assign, owner

NAMES = [f"model.layers.{i}.{part}.weight" for i in range(200) for part in ("q", "k", "v", "o", "up", "down")]


def replicas(*ids: str) -> list[Replica]:
    return [Replica(i, f"{i}:50051", f"http://{i}:8080") for i in ids]


def test_owners_do_not_depend_on_the_order_replicas_are_listed_in() -> None:
    three = replicas("weightsvc-0", "weightsvc-1", "weightsvc-2")
    shuffled = random.Random(0).sample(three, 3)
    assert all(owner(n, three) == owner(n, shuffled) for n in NAMES)


def test_tensors_spread_evenly() -> None:
    counts = {k: len(v) for k, v in assign(NAMES, replicas("a", "b", "c")).items()}
    assert set(counts) == {"a", "b", "c"}
    assert all(0.28 < c / len(NAMES) < 0.39 for c in counts.values()), counts


def test_a_replica_leaving_or_joining_moves_only_its_tensors() -> None:
    three = replicas("a", "b", "c")
    before = {n: owner(n, three).id for n in NAMES}
    after_leave = {n: owner(n, three[:2]).id for n in NAMES}
    assert all(after_leave[n] == before[n] for n in NAMES if before[n] != "c")
    after_join = {n: owner(n, [*three, *replicas("d")]).id for n in NAMES}
    moved = [n for n in NAMES if after_join[n] != before[n]]
    assert all(after_join[n] == "d" for n in moved)
    assert 0.18 < len(moved) / len(NAMES) < 0.32  # about a quarter goes to the newcomer


def test_no_replicas_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no replicas"):
        owner("w", [])
