"""Keeping the event loop free: big work goes to a worker thread, repeated work is done once, and
no full garbage collection stops the world while big work runs.

The event loop serves every transport; it must never wait seconds on one push or pull."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
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
