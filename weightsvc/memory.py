"""Large buffers for data sections.

Fresh anonymous memory is faulted in page by page on first write; on this class of machine that
costs about as much as copying the bytes twice. A big buffer asks for transparent huge pages and
has the kernel fill them in one call, without the GIL (MADV_POPULATE_WRITE; callers do it in a
worker thread): 1 GiB in 0.09 s, against 0.29 s with MAP_POPULATE and 4 KiB pages and 0.55 s
faulted on first write. A kernel without MADV_POPULATE_WRITE (before 5.14) gets MAP_POPULATE.

The kernel holds the process's memory-map lock through one madvise call, and every mmap and munmap
of the process waits for it: a new thread's stack, an arena of Python's allocator, a large malloc,
on the event loop too. One call over 1 GiB of fresh memory held them for 2.4-4.1 s on a loaded
2-core machine; calls of `_POPULATE_PIECE` bytes let them in between (at most 20-60 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

_POPULATE_MIN = 1 << 20
_POPULATE_PIECE = 16 << 20  # a multiple of the huge page size
_MADV_POPULATE_WRITE = 23  # linux/mman.h; not in Python's mmap module before 3.13
_libc = ctypes.CDLL(None, use_errno=True)  # calls release the GIL


def _populated(buf: mmap.mmap) -> bool:
    """Huge pages where the kernel has them, all mapped now; False where it cannot populate."""
    with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages, populated all the same
        buf.madvise(mmap.MADV_HUGEPAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    for at in range(0, len(buf), _POPULATE_PIECE):
        size = min(_POPULATE_PIECE, len(buf) - at)
        if _libc.madvise(ctypes.c_void_p(addr + at), ctypes.c_size_t(size), _MADV_POPULATE_WRITE) != 0:
            return False
    return True


def alloc(nbytes: int) -> memoryview:
    """A writable, uninitialised byte buffer of `nbytes`, its pages already mapped."""
    if nbytes == 0:
        return memoryview(bytearray())
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if nbytes < _POPULATE_MIN:
        return memoryview(mmap.mmap(-1, nbytes, flags=flags))
    buf = mmap.mmap(-1, nbytes, flags=flags)
    if _populated(buf):
        return memoryview(buf)
    buf.close()
    return memoryview(mmap.mmap(-1, nbytes, flags=flags | getattr(mmap, "MAP_POPULATE", 0)))


class BufferPool:
    """Data-section buffers of evicted versions and aborted pushes, handed to the next push of the
    same size.

    A learner pushes a model of the same size every step: reusing the buffer of the version that
    retention just dropped skips mapping fresh pages (measured above). The store gives a buffer
    back only once no pull holds its version, so no reader ever sees it change. The pool keeps only
    what the next push can use: a buffer of the size of a version still retained (`wanted`: the
    next push of that model), one per size, `MAX_BUFFERS` and at most `max_bytes` in all (the
    oldest go first); one not taken within `IDLE_S` goes back to the system, and a push that needs
    the memory it holds has it freed (`free`).
    """

    MAX_BUFFERS = 4
    IDLE_S = 120.0

    def __init__(self, max_bytes: int | None = None, wanted: Callable[[int], bool] = lambda nbytes: True) -> None:
        self.max_bytes = max_bytes
        self.wanted = wanted
        self._free: dict[int, tuple[memoryview, float]] = {}  # size -> (buffer, when given), oldest first
        self._timer: asyncio.TimerHandle | None = None

    def take(self, nbytes: int) -> memoryview | None:
        """A recycled buffer of exactly `nbytes`, or None (then `alloc` one, off the event loop)."""
        kept = self._free.pop(nbytes, None)
        return kept[0] if kept is not None else None

    def give(self, buf: memoryview) -> None:
        # Only our own anonymous mappings: restored versions are read-only file mappings.
        if buf.readonly or not isinstance(buf.obj, mmap.mmap) or len(buf) != len(buf.obj):
            return
        if len(buf) in self._free or (self.max_bytes is not None and len(buf) > self.max_bytes):
            return
        if not self.wanted(len(buf)):
            return
        self._free[len(buf)] = (buf, time.monotonic())
        while len(self._free) > self.MAX_BUFFERS or (self.max_bytes is not None and self.free_bytes > self.max_bytes):
            self._free.pop(next(iter(self._free)))
        self._expire_later()

    def prune(self) -> None:
        """Let go of the buffers no retained version's size wants any more."""
        for nbytes in [n for n in self._free if not self.wanted(n)]:
            del self._free[nbytes]

    def free(self) -> int:
        """Let go of every buffer (their memory returns to the system); the bytes let go of."""
        freed = self.free_bytes
        self._free.clear()
        return freed

    @property
    def free_bytes(self) -> int:
        return sum(len(b) for b, _ in self._free.values())

    def _expire_later(self) -> None:
        """Check for idle buffers when the oldest has been idle for `IDLE_S` (on the running loop; a pool
        used without one only lets go when it is full)."""
        if self._timer is not None or not self._free:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        oldest = min(since for _, since in self._free.values())
        self._timer = loop.call_later(max(0.0, oldest + self.IDLE_S - time.monotonic()), self._expire)

    def _expire(self) -> None:
        self._timer = None
        idle = time.monotonic() - self.IDLE_S
        for nbytes in [n for n, (_, since) in self._free.items() if since <= idle]:
            del self._free[nbytes]
        self._expire_later()


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). What a big push freed
    (its header's and plan's objects, its messages) stays with the allocator otherwise: 100 MiB and
    more after a push of 400,000 tensors. Releases the GIL: call it in a worker thread."""
    fn = getattr(_libc, "malloc_trim", None)
    if fn is not None:
        fn(0)


def resident_bytes() -> int:
    """This process's resident memory (RSS), from /proc; 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def process_status(pid: int | str = "self") -> dict[str, int]:
    """The sizes in /proc/PID/status (VmRSS, VmHWM, RssAnon, RssFile, ...), in bytes; OSError where
    there is no such process or no /proc."""
    with open(f"/proc/{pid}/status") as f:
        fields = (line.partition(":") for line in f)
        return {key: int(value.split()[0]) * 1024 for key, _, value in fields if value.rstrip().endswith(" kB")}


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (RssAnon): what it holds itself, not the pages of the
    files it maps (versions in a data dir), which the kernel writes back and drops as it needs.
    0 where /proc has none."""
    try:
        return process_status().get("RssAnon", 0)
    except (OSError, ValueError):
        return 0


def physical_memory() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit when lower (a pod)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def half_the_memory() -> int:
    """half the memory this process may use"""  # shown as the default in `serve --help`
    return physical_memory() // 2
