"""Rendezvous hashing of tensor names onto replicas."""

from __future__ import annotations

import random

import pytest

from weightsvc.protocol.topology import Replica, assign, owners

NAMES = [f"model.layers.{i}.{part}.weight" for i in range(200) for part in ("q", "k", "v", "o", "up", "down")]


def replicas(*ids: str) -> list[Replica]:
    return [Replica(i, f"{i}:50051", f"http://{i}:8080") for i in ids]


def owner(name: str, among: list[Replica]) -> Replica:
    """The one owner of `name` without replication."""
    (one,) = owners(name, [r.id for r in among], 1)
    return next(r for r in among if r.id == one)


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
        owners("w", [], 2)


def test_with_replication_two_a_replica_leaving_leaves_each_tensor_one_of_its_owners() -> None:
    ids = ["a", "b", "c", "d"]
    before = {n: owners(n, ids, 2) for n in NAMES}
    assert all(len(o) == 2 for o in before.values())
    assert {o[0] for o in before.values()} | {o[1] for o in before.values()} == set(ids)
    after = {n: owners(n, ["a", "b", "d"], 2) for n in NAMES}
    for n in NAMES:
        if "c" not in before[n]:
            assert after[n] == before[n], n  # the others stay where they are
        else:
            assert len(set(after[n]) & set(before[n])) == 1, n  # the other owner keeps it, one more joins
    # The top owner is the one owner of replication 1, and more replicas than there are give all.
    assert all(owners(n, ids, 1)[0] in before[n] for n in NAMES)
    assert owners("w", ["a", "b"], 3) == ("a", "b")
    counts = {k: len(v) for k, v in assign(NAMES, replicas(*ids), 2).items()}
    assert all(0.4 < c / len(NAMES) < 0.6 for c in counts.values()), counts  # each holds about half
