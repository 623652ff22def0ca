"""Commit: what makes a version committed, on a push and again at a restart.

A push's version is written to the data dir first (durable before visible), then the registry
decides (with Redis, across replicas) and announces it, then the index shows it. At a restart the
files are read back and made to agree with the registry (`_restore`); a full disk makes room by
evicting old versions (`_eviction`); a sharded replica shows what the registry committed without it
(`CommitFollower`). The state one version hands to the next lives here: the lag tracker of each
model, and its ef residual (`Residuals`).

Loop-owned: every method runs on the service's event loop, except `restore`, which runs before
the service serves anything; file I/O goes to a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from weightsvc._faults import crash_point
from weightsvc.errors import DiskFull, FailedPrecondition, Unavailable, subject
from weightsvc.metrics import Metrics
from weightsvc.protocol.lag import LagSums, LagTracker, Sample
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.safetensors import check_header_size
from weightsvc.rounding import Residual
from weightsvc.service.record import Version, VersionFile
from weightsvc.service.replicas.parts import PartOf, Parts
from weightsvc.service.replicas.registry import CommitResult, Registry, check_commit, not_above
from weightsvc.service.versions._eviction import make_room, named
from weightsvc.service.versions._restore import Recovery
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.follow import CommitFollower
from weightsvc.service.versions.index import VersionIndex
from weightsvc.service.versions.residuals import Residuals

log = logging.getLogger("weightsvc.store")
T = TypeVar("T")


class Publishing(Protocol):
    """Where whole committed versions are written through to (`service.publish.Publisher`)."""

    async def before_commit(self, version: Version) -> None: ...

    def committed(self, version: Version) -> None: ...


class Committer:
    def __init__(
        self,
        *,
        index: VersionIndex,
        files: VersionFiles | None,
        parts: Parts,
        acks: Acks,
        registry: Registry,
        metrics: Metrics,
        publisher: Publishing | None = None,
    ) -> None:
        self._index = index
        self._files = files
        self._parts = parts
        self._acks = acks
        self._registry = registry
        self._metrics = metrics
        self._locks: dict[str, asyncio.Lock] = {}
        self._committing: set[asyncio.Future[tuple[Version, bool]]] = set()
        self.residuals = Residuals(index, files)
        self._lag: dict[str, LagTracker] = {}
        self._recovery = Recovery(index=index, files=files, parts=parts, acks=acks, registry=registry,
                                  residuals=self.residuals)
        self._giving_back: asyncio.Task[None] | None = None
        self.publisher = publisher  # --object-store: whole versions are written through to it
        self.follower = CommitFollower(index=index, parts=parts, acks=acks, registry=registry, locks=self._locks,
                                 lost=self.registry_lost)

    def check_step(self, model: str, step: int) -> None:
        """A push may target a step above the latest, or an existing one (idempotent re-push)."""
        self._parts.check_not_waiting(model, step)
        latest = self._index.latest(model)
        if latest is not None and step < latest and self._index.find(model, step) is None:
            raise not_above(model, step, latest)

    async def commit(
        self,
        version: Version,
        residual: tuple[int | None, Residual, VersionFile | None] | None = None,
        lag_input: tuple[Sample, int, bool] | None = None,
        part_of: PartOf | None = None,
        lag_sums: LagSums | None = None,
    ) -> tuple[Version, bool]:
        """Make `version` visible (with an `ef` push, also its residual, given with the version of the
        residual it started from and the file it was staged in, if it was). Returns (the committed version, created).
        Its lag metrics come from `lag_input` (a push's sample), or `lag_sums` (a publish's ranks' sums, added
        up); with neither it has none.

        With `part_of`, `version` is this replica's part of a version of sharded replicas: it becomes
        visible when every owner's part is in, or is withdrawn after `part_of.timeout` seconds or once
        `part_of.abandoned` is set, and nothing of it stays.

        Runs to the end even if the pushing stream is cancelled meanwhile: once the file is in
        place the version must also be in memory, or a restart would resurrect a push that the
        learner saw fail.
        """
        if part_of is not None:
            self._parts.check_not_waiting(version.manifest.model, version.manifest.version)
        task = asyncio.ensure_future(self._commit(version, residual, lag_input, part_of, lag_sums))
        self._committing.add(task)
        task.add_done_callback(self._committing.discard)
        return await asyncio.shield(task)

    async def _commit(
        self,
        version: Version,
        residual: tuple[int | None, Residual, VersionFile | None] | None,
        lag_input: tuple[Sample, int, bool] | None,
        part_of: PartOf | None,
        lag_sums: LagSums | None = None,
    ) -> tuple[Version, bool]:
        if part_of is not None:  # the file holds the part alone
            version = self._parts.own(version)
        m = version.manifest
        async with self._locks.setdefault(m.model, asyncio.Lock()):
            existing = self._index.find(m.model, m.version)
            latest = self._index.latest(m.model)
            # Checked here first too: a rejected push must not overwrite this server's files. A part of a
            # version this replica holds none of (committed without it, or it lost its part: it restarted
            # without a data dir) has no part digest here to be compared with: the registry decides.
            elsewhere = part_of is not None and existing is not None and existing.held_elsewhere
            if not elsewhere and not check_commit(m.model, m.version, m.master_digest,
                                                  existing.digest if existing else None, latest):
                assert existing is not None
                return existing, False
            if residual is not None and residual[0] != latest:
                raise FailedPrecondition(
                    f"{subject(m.model, step=m.version)}: version {latest} committed while this ef push "
                    f"continued from version {residual[0]}; push again",
                    reason="step_not_above_latest",
                )
            tracker = self._lag.setdefault(m.model, LagTracker())
            before = tracker.snapshot()
            if lag_input is not None:  # the lag metrics go into the manifest, so into the file too
                m = dataclasses.replace(m, lag=tracker.observe(m.version, *lag_input))
            elif lag_sums is not None:
                m = dataclasses.replace(m, lag=tracker.published(m.version, lag_sums))
            # The manifest's JSON (for the file's header and the registry) and the header, from the
            # final manifest: once each, off the loop (0.25 s and 0.35 s at 100,000 tensors).
            text = await asyncio.to_thread(m.json)
            header = await asyncio.to_thread(m.safetensors_header, text)
            version = dataclasses.replace(version, manifest=m, header=header)
            record = None
            try:
                check_header_size(len(version.header) - 8, subject(m.model, step=m.version))
                if self._files is not None:
                    # Durable before visible: a version reported committed survives a crash. The
                    # residual goes first, named by its version, so a restart pairs it correctly.
                    if residual is not None:
                        write = functools.partial(self.residuals.write, m.model, residual[1], residual[2])
                        await self.on_disk(m.model, m.version, write, locked=True)
                        crash_point("commit.residual-written")
                    # Served from its file now.
                    version = await self.on_disk(m.model, m.version, functools.partial(self._files.write, version),
                                                 locked=True)
                    crash_point("commit.version-renamed")
                if self.publisher is not None and part_of is None:
                    await self.publisher.before_commit(version)  # --object-store-required: in the store first
                # The registry decides (with Redis, across replicas) and announces the version.
                if part_of is None:
                    decided = await self._registered(m, text)
                else:
                    decided, version, record = await self._parts.commit(version, part_of, text)
            except BaseException:
                self._lag[m.model] = before
                if self._files is not None:
                    await asyncio.to_thread(self._files.remove, m.model, m.version, residual is not None)
                raise
            # Committed meanwhile (by another replica, or by an earlier try of this push whose answer
            # was lost): what this server holds of it is served from now on, and a part of it that this
            # replica held none of is taken back when this push brought the bytes committed.
            held = self._index.find(m.model, m.version)
            if version.held_elsewhere and self._files is not None:  # (this push's bytes are not those)
                await asyncio.to_thread(self._files.remove, m.model, m.version, residual is not None)
            if not decided.created and held is not None and (version.held_elsewhere or not held.held_elsewhere):
                self._lag[m.model] = before
                return held, False
            created = decided.created or (part_of is not None and held is None and not version.held_elsewhere)
            if not created:  # an idempotent push: the lag went on from the version it repeats
                self._lag[m.model] = before
            if version.held_elsewhere:
                residual = None
            elif record is not None:  # should the registry lose the version, this replica gives it back
                await self._recovery.records.keep(m.model, m.version, record)
            evicted = self._index.add(version)
            self._recovery.records.forget(m.model, {v.manifest.version for v in self._index.versions(m.model)})
            self._acks.committed(m.model, m.version, (m if created else version.manifest).committed_unix)
            if residual is not None:
                self.residuals.committed(m.model, residual[1])
        if created:
            self._metrics.versions_committed.labels(m.model).inc()
            if m.lag is not None:
                self._metrics.observe_lag(m.model, m.format, m.rounding, m.lag)
        await self._index.announce()
        if self.publisher is not None:
            self.publisher.committed(version)
        crash_point("commit.visible")
        if self._files is not None and (evicted or residual is not None):
            # Outside the lock, so the next commit may be writing its residual meanwhile: bounded by
            # the latest version, the prune leaves that file alone.
            kept, latest = self.residuals.kept(m.model), self._index.latest(m.model)
            await asyncio.to_thread(self._files.prune, m.model, evicted, kept, latest)
        return version, created

    async def _registered(self, m: Manifest, text: str) -> CommitResult:
        """Commit `m` in the registry. One that does not answer may have committed all the same (a
        timeout after its script ran): it is asked whether it holds this very content before the
        commit counts as failed, so the file of a version it announced is never deleted."""
        try:
            return await self._registry.commit(m.model, m.version, m.master_digest, text, self._index.retain)
        except Unavailable:
            try:
                raw = await self._registry.manifest(m.model, m.version)
            except Unavailable:
                raw = None  # it cannot tell either: failed, and a retry of the push will find out
            if raw is None or json.loads(raw).get("master_digest") != m.master_digest:
                raise
            log.warning("model %s version %d: the registry committed it, though its answer was lost", m.model,
                        m.version)
            return CommitResult(created=True)

    async def on_disk(self, model: str, step: int, write: Callable[[], T], *, locked: bool = False) -> T:
        """Run `write` (blocking I/O putting a file of `step` in the data dir) in a worker thread. If the
        disk is full, the model's oldest versions that nothing needs make room (`make_room`), and it
        runs once more. `locked`: the caller holds the model's lock (a commit)."""
        try:
            return await asyncio.to_thread(write)
        except DiskFull as e:
            full = e
        async with contextlib.nullcontext() if locked else self._locks.setdefault(model, asyncio.Lock()):
            assert self._files is not None
            evicted = await make_room(self._index, self._files, model, step, full)
            try:
                return await asyncio.to_thread(write)
            except DiskFull as again:
                raise DiskFull(f"{again.message}, after evicting {named(evicted)} of model {model!r}",
                               needed=again.needed) from None

    def restore(self) -> int:
        """Load committed versions from the data dir; returns how many. Skips damaged files."""
        if self._files is None:
            return 0
        count = self._recovery.restore()
        self._metrics.damaged_files.set(len(self._files.damaged))
        return count

    async def sync_registry(self) -> None:
        """After a restart, make the registry and the restored versions agree (`Recovery.sync_registry`)."""
        await self._recovery.sync_registry()

    def registry_lost(self) -> None:
        """The registry lost its data (this replica's registration, or a model it holds, vanished):
        give it back every version this replica holds (`Recovery.give_back`), in the background."""
        self._parts.registry_lost()
        if self._giving_back is None or self._giving_back.done():
            self._giving_back = asyncio.create_task(self.give_back(), name="give-back")

    async def give_back(self) -> None:
        """Give the registry back the versions it lost that this replica holds; those it decides
        against (retention, other content) go."""
        for model in self._index.models():
            try:
                async with self._locks.setdefault(model, asyncio.Lock()):
                    against = await self._recovery.give_back(model)
                    self._index.drop(model, [v for v in against if self._index.find(model, v) is not None])
            except Unavailable as e:
                log.warning("model %s: cannot give the registry its versions back yet: %s", model, e)
                continue
            if against:
                log.warning("model %s: the registry decided against %s (retention, or other content); dropped",
                            model, named(against))
                if self._files is not None:
                    await asyncio.to_thread(self._files.prune, model, against, self.residuals.kept(model),
                                            self._index.latest(model))
