"""Keeping the event loop free: big work goes to a worker thread, repeated work is done once, no
full garbage collection stops the world while big work runs, and big structures are freed a piece at a
time in a thread of their own.

The event loop serves every transport; it must never wait seconds on one push or pull."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sized
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
K = TypeVar("K")

BIG_MANIFEST = 2000  # tensors: work on a manifest this size takes milliseconds, and goes off the loop


class _Listing(Protocol):
    @property
    def tensors(self) -> Sized: ...


async def in_thread(big: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`: in a worker thread when `big`, else inline (a thread costs more than small work).
    Big work makes objects by the thousand: no full collection runs meanwhile (`no_full_collections`)."""
    if not big:
        return fn(*args)
    with no_full_collections(True):
        return await asyncio.to_thread(fn, *args)


async def off_loop(fn: Callable[..., T], m: _Listing, *args: Any) -> T:
    """`fn(m, *args)`, off the event loop for a big manifest."""
    return await in_thread(len(m.tensors) >= BIG_MANIFEST, fn, m, *args)


_memos: dict[tuple[int, str], Any] = {}


def memo(obj: K, kind: str, make: Callable[[K], T]) -> T:
    """`make(obj)`, computed once per object and kind while the object lives: the encodings a
    transport sends of a version's manifest (a fleet pulls the same one; they cost 0.1-0.7 s at
    100,000 tensors). Safe from any thread (two first callers may both compute it)."""
    key = (id(obj), kind)
    got = _memos.get(key)
    if got is None:
        got = _memos[key] = make(obj)
        weakref.finalize(obj, _memos.pop, key, None)
    return got  # type: ignore[no-any-return]


_quiet = 0  # big works in progress that hold off the full collections (servers on several loops: a lock)
_quiet_lock = threading.Lock()
_threshold = gc.get_threshold()


@contextlib.contextmanager
def no_full_collections(big: bool) -> Iterator[None]:
    """While a `big` work runs (a push of thousands of tensors), the cyclic garbage collector does
    not run a full collection. One walks every object alive while it holds the GIL, and so the
    event loop: 0.1-0.3 s with the objects a push of 100,000 tensors keeps alive (a few a tensor),
    about 1 s at 400,000, again each time the objects alive grow by a quarter. The young generations
    are still collected, and what a push leaves is freed by reference counting as it ends, so the next
    full collection finds little to do."""
    global _quiet, _threshold
    if not big:
        yield
        return
    with _quiet_lock:
        if _quiet == 0:
            _threshold = gc.get_threshold()
            gc.set_threshold(_threshold[0], _threshold[1], 1 << 30)
        _quiet += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet -= 1
            if _quiet == 0:
                gc.set_threshold(*_threshold)


# A container of hundreds of thousands of objects (a push's tensor specs, its plan) freed at once holds
# the GIL, and so the event loop, for as long as the frees take: about 90 ms per 400,000 objects, and a
# push of 400,000 tensors leaves several such containers. The reaper takes them apart instead, one item
# at a time, so that the GIL changes hands between items.
REAP_WAIT_S = 300.0  # a container still held elsewhere after this long is left to its other holders
_REAP_POLL_S = 0.05
_reaped: queue.SimpleQueue[Any] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def let_go(*containers: object) -> None:
    """Free each container (tuple, list or dict) and its items in the reaper thread once nothing
    else holds it (its other holders just drop their references, in any order)."""
    global _reaper
    for c in containers:
        _reaped.put(c)
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="weightsvc-reaper", daemon=True)
            _reaper.start()


def _reap() -> None:
    waiting: list[list[Any]] = []  # [container, deadline]: still held elsewhere
    while True:
        with contextlib.suppress(queue.Empty):
            c = _reaped.get(timeout=_REAP_POLL_S if waiting else None)
            if not any(entry[0] is c for entry in waiting):  # (one let go of twice: the entries would hold each other)
                waiting.append([c, time.monotonic() + REAP_WAIT_S])
            del c
        for entry in waiting:
            # Held by `entry` and getrefcount's argument alone: nothing else holds it.
            if sys.getrefcount(entry[0]) <= 2:
                _take_apart([entry.pop(0)])
            elif entry[1] < time.monotonic():
                entry.pop(0)
        waiting = [entry for entry in waiting if len(entry) == 2]


def _take_apart(stack: list[Any]) -> None:
    """Free the containers on `stack` (each held by the stack alone) one item at a time; an item that is
    itself a big container held by nothing else goes on the stack."""
    while stack:
        c = stack.pop()
        if isinstance(c, tuple):
            c = list(c)  # (the tuple goes: its items stay, held by the list)
        while c:
            item = c.popitem()[1] if isinstance(c, dict) else c.pop()
            # Held by `item` and getrefcount's argument alone: its items are taken apart too.
            if isinstance(item, tuple | list | dict) and len(item) >= BIG_MANIFEST and sys.getrefcount(item) <= 2:
                stack.append(item)
            del item
