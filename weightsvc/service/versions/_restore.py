"""A restart: the data dir's versions read back, then made to agree with the registry; and a registry
that lost its data (restarted empty, failed over to an empty replica, flushed) given the versions back.

A version goes only where the registry decided against it: it holds other content under that number,
retention leaves it out, or (a part written before a crash) it took the part back; never because it
does not know the version. A sharded replica keeps the registry's record of each version it holds a
part of (`Records`), and gives it back from that record: the same digest and manifest as before, from
whichever holder is up first.

`restore` runs before the service serves anything; the rest on the service's event loop, its file I/O
in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging

from weightsvc.errors import AlreadyExists, FailedPrecondition, WeightsvcError
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.replicas.registry import Registry, record_digest
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.disk import VersionFiles, read_record, write_record
from weightsvc.service.versions.index import VersionIndex
from weightsvc.service.versions.residuals import Residuals

log = logging.getLogger("weightsvc.store")


class Records:
    """The registry's record of each committed version this replica holds a part of (the parts of
    every owner, as `Registry.manifest` returns it): beside the part's file in the data dir, or in
    memory without one. Loop-owned."""

    def __init__(self, files: VersionFiles | None) -> None:
        self._files = files
        self._held: dict[str, dict[int, str]] = {}  # without a data dir: model -> version -> record

    async def keep(self, model: str, version: int, record: str) -> None:
        """Keep a version's record (the version is committed whether or not it can be kept)."""
        if self._files is None:
            self._held.setdefault(model, {})[version] = record
            return
        try:
            await asyncio.to_thread(write_record, self._files, model, version, record)
        except WeightsvcError as e:
            log.error("model %s version %d: committed, but should the registry lose it, this replica cannot "
                      "give it back: %s", model, version, e)

    async def get(self, model: str, version: int) -> str | None:
        if self._files is None:
            return self._held.get(model, {}).get(version)
        return await asyncio.to_thread(read_record, self._files, model, version)

    def forget(self, model: str, retained: set[int]) -> None:
        """Forget the records of versions no longer retained (in the data dir, they go with their files)."""
        held = self._held.get(model, {})
        for v in [v for v in held if v not in retained]:
            del held[v]


class Recovery:
    """A restart, and a registry that lost its data: the versions this server holds and the registry
    made to agree. Holds the registry's records of this replica's parts (`records`); the rest it
    shares with the committer that builds it."""

    def __init__(self, *, index: VersionIndex, files: VersionFiles | None, parts: Parts, acks: Acks,
                 registry: Registry, residuals: Residuals) -> None:
        self._index = index
        self._files = files
        self._parts = parts
        self._acks = acks
        self._registry = registry
        self._residuals = residuals
        self.records = Records(files)

    def restore(self) -> int:
        """Load committed versions from the data dir into the index (and each model's ef residual);
        returns how many. Skips damaged files."""
        if self._files is None:
            return 0
        count = 0
        for model, versions, residual in self._files.restore():
            if not versions:
                continue
            evicted = []
            for version in versions:
                evicted += self._index.add(version)
                self._acks.committed(model, version.manifest.version, version.manifest.committed_unix)
            if residual is not None:
                self._residuals.committed(model, residual)
            self._files.prune(model, evicted, self._residuals.kept(model))
            count += len(versions)
        return count

    async def sync_registry(self) -> None:
        """After a restart, make the registry and the restored versions agree. A part is served under the
        registry's record of its version, given back from its own record if the registry lost it
        (`Parts.restored`). A whole version the registry never committed (a crash between the file and
        the registry) above its latest is dropped; one below its latest that it does not know (it lost
        its data) is given back to it, and dropped only if retention leaves it out or the registry holds
        other content under its number; a registry that knows nothing of a model (a fresh one, the
        embedded one, or one that lost its data) takes the files."""
        index, parts, registry, records = self._index, self._parts, self._registry, self.records
        for model in index.models():
            known = await registry.versions(model)
            dropped = []
            for version in index.versions(model):
                m = version.manifest
                if m.parts:  # a part: served again only as part of what the registry holds
                    record = await records.get(model, m.version)
                    whole, raw = await parts.restored(version, record)
                    if whole is None or raw is None:
                        dropped.append(m.version)
                        continue
                    index.add(whole)
                    if record is None:  # (committed before records were kept, or a crash before it was)
                        await records.keep(model, m.version, raw)
                    elif m.version not in known:  # given back: the other replicas may not have registered again yet
                        parts.registry_lost()
                        parts.replicas_seen = max(parts.replicas_seen, len({h for p in whole.manifest.parts
                                                                            for h in p.sources}))
                    continue
                if m.version in known:
                    continue
                if known and m.version > known[-1]:
                    dropped.append(m.version)
                    continue
                if not await _give_back(registry, index.retain, m.model, m.version, m.master_digest,
                                        await asyncio.to_thread(m.json)):
                    dropped.append(m.version)
            for v in dropped:
                log.warning("model %s version %d: restored, but the registry decided against it (another digest, a "
                            "withdraw, or retention); dropped", model, v)
            index.drop(model, dropped)
            if dropped and self._files is not None:
                await asyncio.to_thread(self._files.prune, model, dropped, self._residuals.kept(model))

    async def give_back(self, model: str) -> list[int]:
        """Give the registry back every version of `model` this running replica holds and the registry
        does not know (it lost its data): a part from its record, a whole version from its manifest.
        Returns the versions the registry decided against (retention, or other content), for the caller
        to drop. Call under the model's lock."""
        known = set(await self._registry.versions(model))
        against = []
        for version in self._index.versions(model):
            m, part = version.manifest, version.part
            if m.version in known or (part is not None and not part.parts):
                continue  # known, or shown without a part here (served by the replicas that hold it)
            if part is None:
                digest, record = m.master_digest, await asyncio.to_thread(m.json)
            else:
                got = await self.records.get(model, m.version)
                if got is None:
                    log.error("model %s version %d: the registry lost it, and this replica kept no record of it to "
                              "give it back; its other holders may", model, m.version)
                    continue
                digest, record = record_digest(got), got
            if await _give_back(self._registry, self._index.retain, model, m.version, digest, record):
                log.warning("model %s version %d: the registry had lost it; given back", model, m.version)
            else:
                against.append(m.version)
        return against


async def _give_back(registry: Registry, retain: int, model: str, version: int, digest: str, record: str) -> bool:
    """Restore a committed version the registry does not know: True if it holds it now, False if
    retention leaves it out or it holds other content under that number."""
    try:
        return await registry.restore(model, version, digest, record, retain)
    except (AlreadyExists, FailedPrecondition):
        return False
