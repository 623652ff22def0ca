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

from weightsvc._aio import BIG_MANIFEST, let_go
from weightsvc.errors import NotFound
from weightsvc.memory import BufferPool
from weightsvc.metrics import Metrics
from weightsvc.service.record import FileRange as FileRange  # (re-exported: the transports read it here)
from weightsvc.service.record import Version
from weightsvc.service.record import VersionFile as VersionFile


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
