"""A committed version as this server holds it: its manifest, its header and the bytes it serves (a
whole version, or a sharded replica's part of one), and the file they lie in with a data dir.

Its own module: the versions this server keeps (`versions/`) and the registry's bookkeeping of parts
(`replicas/`) both read it, and neither depends on the other for it.

Where a version's bytes lie is answered here, for every transport: `Version.file_range` by range of
the safetensors file, `Version.pieces` by tensor and slice (`selection.byte_ranges`: as few ranges as
the layout allows). Both answer views of memory or `FileRange`s of the version's file, so a
transport sends (or registers) what it gets and never reaches for the buffer, the mapping or the
parts behind it.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from weightsvc.errors import FailedPrecondition, subject
from weightsvc.protocol.manifest import Manifest, ServedTensor, Slice
from weightsvc.protocol.parts import Segment, held_span
from weightsvc.protocol.selection import byte_ranges, owner_of, picked


@dataclass(frozen=True)
class FileRange:
    """Bytes [offset, offset + count) of an open file, for a transport that sends them without copying."""

    file: BinaryIO
    offset: int
    count: int

    def __len__(self) -> int:  # (a piece's size, whether bytes or a range of a file)
        return self.count


@dataclass(eq=False)
class VersionFile:
    """The file a version's data section lives in (a data dir), open and mapped: pulls read the
    mapping or send the file itself, so the bytes sit in the page cache, not in this process's memory."""

    path: Path
    file: BinaryIO
    mapping: mmap.mmap
    data_start: int  # the file offset of the data section

    @property
    def data(self) -> memoryview:
        return memoryview(self.mapping)[self.data_start :]

    def close(self) -> None:
        """Unmap and close. A view still held by a transport keeps the mapping until it is dropped."""
        with contextlib.suppress(BufferError, ValueError):
            self.mapping.close()
        self.file.close()


@dataclass(eq=False)
class Version:
    """A committed version. Its bytes never change; `readers` and `evicted` are the index's."""

    manifest: Manifest
    header: bytes  # the safetensors prefix
    data: memoryview  # the data section (uint8)
    readers: int = 0  # pulls in progress
    evicted: bool = False
    shared_views: bool = False  # views of `data` were handed to code we do not control: never recycle
    # Sharded replicas: this replica's part of the version (the manifest of its own file; `manifest`
    # is then the whole version's) and which bytes of the version's data section `data` holds.
    part: Manifest | None = None
    segments: tuple[Segment, ...] = ()
    # With a data dir: the file `data` maps (its data section is `data`, this replica's bytes).
    file: VersionFile | None = None

    @functools.cached_property
    def by_name(self) -> dict[str, ServedTensor]:
        """The version's tensors by name (a lease of many looks each up)."""
        return {t.name: t for t in self.manifest.tensors}

    @property
    def spans(self) -> tuple[Segment, ...]:
        """The ranges of the version's data section that this server holds (all of it, or a part's)."""
        return self.segments if self.part is not None else (Segment(0, 0, len(self.data)),)

    def span(self, start: int, end: int) -> Segment | None:
        """The held range that holds the bytes [start, end) of the data section, if one does."""
        return held_span(self.spans, start, end)

    @functools.cached_property
    def etag(self) -> str:
        """The HTTP entity tag of this version's file (hashes its header: computed once)."""
        return self.manifest.etag(self.header)

    @classmethod
    def elsewhere(cls, whole: Manifest) -> Version:
        """A sharded version as a replica that holds none of its bytes shows it (committed without it,
        or its part was lost): the whole manifest and no data; clients fetch the bytes from the replicas
        that hold them. Blocking (makes the file's header)."""
        return cls(whole, whole.safetensors_header(), memoryview(b""),
                   part=replace(whole, tensors=(), data_bytes=0, parts=()))

    @property
    def held_elsewhere(self) -> bool:
        """Whether this server shows the version without holding any of it (`elsewhere`)."""
        return self.part is not None and not self.part.parts

    @property
    def digest(self) -> str:
        """The master digest of what this server committed (its part's, for a part; for a version held
        elsewhere, the whole version's: no part's to compare a push with)."""
        return (self.part or self.manifest).master_digest

    @property
    def size(self) -> int:
        """Bytes of the version's safetensors file (of which a part's replica holds the header and its part)."""
        return len(self.header) + self.manifest.data_bytes

    def file_range(self, start: int, end: int, piece: int, zero_copy: bool = False) -> Iterator[memoryview | FileRange]:
        """Pieces of at most `piece` bytes covering [start, end) of the safetensors file (for a part:
        a range of the header and the bytes this replica holds). With `zero_copy`, the data section of
        a version in a file comes as ranges of that file, for the transport to send as they are."""
        head = memoryview(self.header)
        at = self.span(max(start, len(head)) - len(head), max(end - len(head), 0))
        skip = len(head) + (at.start - at.local if at is not None else 0)  # offset of data[0] in the served file
        while start < end:
            if start < len(head):
                stop = min(end, len(head), start + piece)
                yield head[start:stop]
            else:
                stop = min(end, start + piece)
                if zero_copy and self.file is not None:
                    yield FileRange(self.file.file, self.file.data_start + start - skip, stop - start)
                else:
                    yield self.data[start - skip : stop - skip]
            start = stop

    def pieces(self, name: str, cut: Slice | None = None, *, zero_copy: bool = False) -> list[memoryview | FileRange]:
        """Where the bytes of tensor `name`, or of its slice `cut`, lie on this server: one piece per
        range of `selection.byte_ranges`, in row-major order (a whole tensor or a dim-0 range is one).
        Views of memory, or with `zero_copy` and a version in a file, ranges of that file. They stay
        valid while the version is held (an open pull).

        INVALID_ARGUMENT for a tensor the version lacks or a slice outside it, as a selection words it;
        FAILED_PRECONDITION for a tensor that other replicas hold (a sharded replica holds its part)."""
        if zero_copy and self.file is not None:
            at = self.file.data_start
            return [FileRange(self.file.file, at + o, n) for o, n in self.ranges(name, cut)]
        return [self.data[o : o + n] for o, n in self.ranges(name, cut)]

    def ranges(self, name: str, cut: Slice | None = None) -> list[tuple[int, int]]:
        """`pieces` as (offset in `data`, nbytes) ranges (their errors too)."""
        m = self.manifest
        t = picked(m, self.by_name, name, cut)
        held = self.span(t.offset, t.offset + t.nbytes)
        if held is None:
            raise FailedPrecondition(
                f"{subject(m.model, m.version, tensor=name)} is held by other replicas ({owner_of(m, t)}), not "
                "by this one: read its bytes from its owners (the InferenceClient does)"
            )
        skip = held.start - held.local  # byte o of the data section is data[o - skip]
        return [(o - skip, n) for o, n in byte_ranges(t, cut)]
