"""The committed versions this server retains, per model: lookup, retention, pulls holding a version
and the recycling of its buffer.

Loop-owned: every method runs on the service's event loop. A `Version` is immutable once committed;
evicting it only drops the index's reference, so a pull that still holds it finishes from the same
bytes, and its buffer goes back to the pool (or its file is unmapped) when that pull ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from weightsvc._aio import BIG_MANIFEST, let_go
from weightsvc.errors import NotFound
from weightsvc.memory import BufferPool
from weightsvc.metrics import Metrics
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.parts import Segment, held_span


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

    @property
    def digest(self) -> str:
        """The master digest of what this server committed (its part's, for a part)."""
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


class VersionIndex:
    """The newest `retain` committed versions of each model, and the buffers of evicted ones."""

    def __init__(self, retain: int, metrics: Metrics, pool_bytes: int | None = None) -> None:
        self.retain = retain
        self.metrics = metrics
        self.pool = BufferPool(pool_bytes, wanted=self._retained_size)  # (at most `pool_bytes` kept for reuse)
        self._versions: dict[str, dict[int, Version]] = {}
        self._changed = asyncio.Condition()

    def models(self) -> list[str]:
        return sorted(m for m, vs in self._versions.items() if vs)

    def latest(self, model: str) -> int | None:
        vs = self._versions.get(model)
        return max(vs) if vs else None

    def find(self, model: str, version: int) -> Version | None:
        """A retained version, or None."""
        return self._versions.get(model, {}).get(version)

    def versions(self, model: str) -> list[Version]:
        vs = self._versions.get(model)
        if not vs:
            raise NotFound(f"unknown model {model!r}: nothing has been committed for it")
        return [vs[k] for k in sorted(vs)]

    def get(self, model: str, version: int | None) -> Version:
        """A committed version; `None` means the latest."""
        vs = self._versions.get(model)
        if not vs:
            raise NotFound(f"unknown model {model!r}: nothing has been committed for it")
        if version is None:
            return vs[max(vs)]
        if version not in vs:
            kept = ", ".join(map(str, sorted(vs)))
            raise NotFound(f"model {model!r} has no version {version} (retained: {kept})")
        return vs[version]

    def hold(self, version: Version) -> None:
        """A pull starts reading `version`: its buffer stays untouched until `release`."""
        version.readers += 1

    def release(self, version: Version) -> None:
        version.readers -= 1
        if version.evicted and version.readers == 0:
            self._recycle(version)

    def add(self, version: Version) -> list[int]:
        """Make `version` visible (in place of a retained one of the same number, as a restored part
        under its whole manifest); returns the versions retention evicted for it."""
        m = version.manifest
        self._versions.setdefault(m.model, {})[m.version] = version
        evicted = self._evict(m.model)
        self.pool.prune()
        self._update_gauges(m.model)
        return evicted

    def drop(self, model: str, versions: list[int]) -> None:
        """Forget versions that turned out not to be committed (restored, and unknown to the registry),
        or that went to make room on a full disk. A pull that holds one finishes from its bytes."""
        vs = self._versions.get(model, {})
        for v in versions:
            self._retire(vs.pop(v))
        self.pool.prune()
        self._update_gauges(model)

    async def announce(self) -> None:
        """Wake the watchers waiting for versions to show."""
        async with self._changed:
            self._changed.notify_all()

    async def shown(self, model: str, version: int) -> Version | None:
        """`version` once this index shows it or a newer one: the registry may announce a version a
        moment before the commit that made it adds it here. None if already evicted."""
        async with self._changed:
            await self._changed.wait_for(functools.partial(self._has_at_least, model, version))
        return self.find(model, version)

    def _has_at_least(self, model: str, version: int) -> bool:
        latest = self.latest(model)
        return latest is not None and latest >= version

    def _evict(self, model: str) -> list[int]:
        vs = self._versions[model]
        evicted = sorted(vs)[: max(0, len(vs) - self.retain)]
        for v in evicted:
            self._retire(vs.pop(v))
        return evicted

    def _retire(self, version: Version) -> None:
        version.evicted = True
        # Its tensors are freed in the reaper, once the last pull of it lets go of them too.
        let_go(*(m.tensors for m in (version.manifest, version.part)
                 if m is not None and len(m.tensors) >= BIG_MANIFEST))
        if version.readers == 0:  # else the last pull to end gives it back
            self._recycle(version)

    def _recycle(self, version: Version) -> None:
        if version.file is not None:
            with contextlib.suppress(BufferError):  # still exported: the mapping goes with the last view
                version.data.release()
            version.file.close()
        elif not version.shared_views:
            self.pool.give(version.data)

    def _retained_size(self, nbytes: int) -> bool:
        """Whether a version of `nbytes` of data is retained: the next push of its model is likely that size."""
        return any(len(v.data) == nbytes for vs in self._versions.values() for v in vs.values())

    def _update_gauges(self, model: str) -> None:
        vs = self._versions.get(model, {})
        self.metrics.retained_versions.labels(model).set(len(vs))
        self.metrics.retained_bytes.labels(model).set(sum(len(v.data) for v in vs.values()))
        if vs:
            self.metrics.latest_version.labels(model).set(max(vs))
