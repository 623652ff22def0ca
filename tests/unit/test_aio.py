"""Big structures are freed in the reaper thread, a piece at a time, and only once nothing else holds
them; sliced work gives the same result as the one call it replaces."""

from __future__ import annotations

import threading
import weakref

import numpy as np

from weightsvc._aio import BIG_MANIFEST, let_go
from weightsvc.service.push.export import CONCAT_SLICE, _concatenate

WAIT_S = 30


class Item:
    """An object that says in which thread it was freed."""

    def __init__(self, freed: list[str], done: threading.Event | None = None) -> None:
        weakref.finalize(self, lambda: (freed.append(threading.current_thread().name), done and done.set()))


def test_a_container_is_freed_in_the_reaper_once_its_last_other_holder_lets_go() -> None:
    freed: list[str] = []
    done = threading.Event()
    items = tuple([Item(freed, done)] + [Item(freed) for _ in range(BIG_MANIFEST * 2)])  # (the first goes last)
    holder = {"specs": items}
    let_go(items)
    let_go(items)  # (two holders may each let go of it)
    del items
    # Still held by `holder`: nothing is freed however long the reaper waits.
    assert not done.wait(0.3) and not freed
    holder.clear()
    assert done.wait(WAIT_S), "the reaper frees the container once nothing else holds it"
    assert len(freed) == BIG_MANIFEST * 2 + 1 and set(freed) == {"weightsvc-reaper"}


def test_nested_big_containers_are_taken_apart_too_and_shared_items_survive() -> None:
    freed: list[str] = []
    done = threading.Event()
    shared = Item(freed)
    plan = {"tensors": {f"t{i}": Item(freed) for i in range(BIG_MANIFEST)},
            "slots": [Item(freed, done)] + [Item(freed) for _ in range(BIG_MANIFEST)],  # (after the tensors)
            "kept": shared}
    let_go(plan)
    del plan
    assert done.wait(WAIT_S)
    assert len(freed) == 2 * BIG_MANIFEST + 1 and set(freed) == {"weightsvc-reaper"}
    assert isinstance(shared, Item)  # still ours: only the reaper's reference went


def test_sliced_concatenate_equals_one_concatenate() -> None:
    rng = np.random.default_rng(0)
    for count in (0, 1, CONCAT_SLICE, CONCAT_SLICE + 1, 2 * CONCAT_SLICE + 7):
        arrays = [rng.standard_normal(int(rng.integers(0, 4))).astype(np.float32) for _ in range(count)]
        got = _concatenate(arrays, np.float32)
        want = np.concatenate(arrays) if arrays else np.zeros(0, np.float32)
        assert got.dtype == np.float32 and np.array_equal(got, want)
