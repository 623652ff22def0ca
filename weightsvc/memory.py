"""Large buffers for data sections.

Fresh anonymous memory is faulted in page by page on first write; on this class of machine that
costs about as much as copying the bytes twice. A big buffer asks for transparent huge pages and
has the kernel fill them in one call, without the GIL (MADV_POPULATE_WRITE; callers do it in a
worker thread): 1 GiB in 0.09 s, against 0.29 s with MAP_POPULATE and 4 KiB pages and 0.55 s
faulted on first write. A kernel without MADV_POPULATE_WRITE (before 5.14) gets MAP_POPULATE.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from pathlib import Path

_POPULATE_MIN = 1 << 20
_MADV_POPULATE_WRITE = 23  # linux/mman.h; not in Python's mmap module before 3.13
_libc = ctypes.CDLL(None, use_errno=True)  # calls release the GIL


def _populated(buf: mmap.mmap) -> bool:
    """Huge pages where the kernel has them, all mapped now; False where it cannot populate."""
    with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages, populated all the same
        buf.madvise(mmap.MADV_HUGEPAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(buf)), _MADV_POPULATE_WRITE) == 0


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
    back only once no pull holds its version, so no reader ever sees it change. The pool holds one
    buffer per size and at most `max_bytes` in all (the oldest go first); a push that needs the
    memory it holds has it freed (`free`).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, memoryview] = {}  # size -> buffer, oldest first

    def take(self, nbytes: int) -> memoryview | None:
        """A recycled buffer of exactly `nbytes`, or None (then `alloc` one, off the event loop)."""
        return self._free.pop(nbytes, None)

    def give(self, buf: memoryview) -> None:
        # Only our own anonymous mappings: restored versions are read-only file mappings.
        if buf.readonly or not isinstance(buf.obj, mmap.mmap) or len(buf) != len(buf.obj):
            return
        if len(buf) in self._free or (self.max_bytes is not None and len(buf) > self.max_bytes):
            return
        self._free[len(buf)] = buf
        while self.max_bytes is not None and self.free_bytes > self.max_bytes:
            self._free.pop(next(iter(self._free)))

    def free(self) -> int:
        """Let go of every buffer (their memory returns to the system); the bytes let go of."""
        freed = self.free_bytes
        self._free.clear()
        return freed

    @property
    def free_bytes(self) -> int:
        return sum(len(b) for b in self._free.values())


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
