"""A restart: the data dir's versions read back, then made to agree with the registry.

`restore` runs before the service serves anything; `sync_registry` on the service's event loop,
its file I/O in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from weightsvc.errors import AlreadyExists, FailedPrecondition
from weightsvc.rounding import Residual
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.replicas.registry import Registry
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.index import VersionIndex

log = logging.getLogger("weightsvc.store")


def kept_residual(residuals: Mapping[str, Residual], model: str) -> int | None:
    """The version whose residual file is the model's current ef state (the others go)."""
    r = residuals.get(model)
    return None if r is None else r.version


def restore(files: VersionFiles, index: VersionIndex, acks: Acks, residuals: dict[str, Residual]) -> int:
    """Load committed versions from the data dir into `index` (and each model's ef residual into
    `residuals`); returns how many. Skips damaged files."""
    count = 0
    for model, versions, residual in files.restore():
        if not versions:
            continue
        evicted = []
        for version in versions:
            evicted += index.add(version)
            acks.committed(model, version.manifest.version, version.manifest.committed_unix)
        if residual is not None:
            residuals[model] = residual
        files.prune(model, evicted, kept_residual(residuals, model))
        count += len(versions)
    return count


async def sync_registry(
    index: VersionIndex, files: VersionFiles | None, parts: Parts, registry: Registry,
    residuals: Mapping[str, Residual],
) -> None:
    """Make the registry and the restored versions agree. A version the registry never committed (a
    crash between the file and the registry) above its latest is dropped; one below its latest that
    it does not know (it lost its data) is given back to it, and dropped only if retention leaves it
    out or the registry holds other content under its number; a registry that knows nothing of a
    model (a fresh one, or the embedded one) takes the files."""
    for model in index.models():
        known = await registry.versions(model)
        dropped = []
        for version in index.versions(model):
            m = version.manifest
            if m.parts:  # a part: served again only as part of what the registry holds
                whole = await parts.restored(version)
                if whole is None:
                    dropped.append(m.version)
                else:
                    index.add(whole)
                continue
            if m.version in known:
                continue
            if known and m.version > known[-1]:
                dropped.append(m.version)
                continue
            text = await asyncio.to_thread(m.json)
            if known:  # below its latest: the registry lost it (its data), or retention let it go
                try:
                    if not await registry.restore(model, m.version, m.master_digest, text, index.retain):
                        dropped.append(m.version)  # older than what retention keeps
                except AlreadyExists:
                    dropped.append(m.version)  # the registry holds other content under that number
                continue
            try:
                await registry.commit(model, m.version, m.master_digest, text, index.retain)
            except (AlreadyExists, FailedPrecondition):
                dropped.append(m.version)  # retired meanwhile, or replaced: the registry decides
        for v in dropped:
            log.warning("model %s version %d: restored, but not committed in the registry; dropped", model, v)
        index.drop(model, dropped)
        if dropped and files is not None:
            await asyncio.to_thread(files.prune, model, dropped, kept_residual(residuals, model))
