"""A full data dir: the model's oldest versions that nothing needs are evicted to make room.

Loop-owned: runs on the service's event loop, under the model's lock; file I/O goes to a worker thread.
"""

from __future__ import annotations

import asyncio
import logging

from weightsvc.errors import DiskFull
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.index import VersionIndex

log = logging.getLogger("weightsvc.store")


async def make_room(index: VersionIndex, files: VersionFiles, model: str, step: int, full: DiskFull) -> list[int]:
    """Evict the model's oldest versions, deleting their files, until `full.needed` bytes are free
    (or, under a quota the free space does not show, were freed). The latest version stays (an ef
    push continues from it), and so do `step` (the one being written) and one that a pull holds (its
    blocks stay taken until the pull ends). A sharded replica's part of a version stays too: the
    registry retains that version, and its other holders count on this one (the push that does not
    fit is refused instead, as where nothing else may go). Nothing goes when all that may go would
    not make room. Returns the versions evicted."""
    latest = index.latest(model)
    retained = index.versions(model) if latest is not None else []
    victims = [v.manifest.version for v in retained
               if v.manifest.version not in (latest, step) and not v.readers and v.part is None]
    kept = "the latest version, versions being pulled and this replica's parts of retained versions stay"
    if not victims:
        raise DiskFull(f"{full.message}; no version of model {model!r} may go to make room ({kept})",
                       needed=full.needed)
    sizes = await asyncio.to_thread(lambda: [files.allocated(model, v) for v in victims])
    free = await asyncio.to_thread(files.free_bytes)
    if free + sum(sizes) < full.needed:
        raise DiskFull(f"{full.message}; evicting {named(victims)} would free only {sum(sizes):,} bytes, "
                       f"so none was evicted ({kept})", needed=full.needed)
    evicted: list[int] = []
    freed = 0
    for v, size in zip(victims, sizes, strict=True):
        if evicted and (free >= full.needed or freed >= full.needed):
            break
        version = index.find(model, v)
        if version is None or version.readers:  # gone meanwhile, or a pull started
            continue
        try:  # the file first: from here on a restart does not bring the version back
            await asyncio.to_thread(files.evict, model, v)
        except OSError as e:
            log.error("model %s version %d: cannot delete its file to make room: %s", model, v, e)
            break
        index.drop(model, [v])
        evicted.append(v)
        freed += size
        free = await asyncio.to_thread(files.free_bytes)
    if evicted:
        log.warning("model %s: the data dir is full: evicted %s (%d bytes) to make room for version %d",
                    model, named(evicted), freed, step)
    return evicted


def named(versions: list[int]) -> str:
    return f"version{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}" if versions else "no version"
