"""Commit: what makes a version committed, on a push and again at a restart.

A push's version is written to the data dir first (durable before visible), then the registry
decides (with Redis, across replicas) and announces it, then the index shows it. At a restart the
files are read back and made to agree with the registry. The state one version hands to the next
(the ef residual and the lag tracker of each model) lives here.

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
from collections.abc import Callable, Mapping
from typing import TypeVar

from weightsvc._faults import crash_point
from weightsvc.errors import AlreadyExists, DiskFull, FailedPrecondition, Unavailable
from weightsvc.metrics import Metrics
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.safetensors import check_header_size
from weightsvc.protocol.selection import holders_by_tensor
from weightsvc.protocol.topology import Group
from weightsvc.rounding import PACKED_SUFFIX, Residual
from weightsvc.service.replicas.parts import PartOf, Parts
from weightsvc.service.replicas.registry import CommitResult, Registry, check_commit, manifest_from_registry
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.index import Version, VersionFile, VersionIndex
from weightsvc.service.versions.lag import LagTracker, Sample

log = logging.getLogger("weightsvc.store")
FOLLOW_MODELS_S = 2.0  # how soon a sharded replica follows a model that is new to it
T = TypeVar("T")


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
    ) -> None:
        self._index = index
        self._files = files
        self._parts = parts
        self._acks = acks
        self._registry = registry
        self._metrics = metrics
        self._locks: dict[str, asyncio.Lock] = {}
        self._committing: set[asyncio.Future[tuple[Version, bool]]] = set()
        self._residuals: dict[str, Residual] = {}
        self._lag: dict[str, LagTracker] = {}

    def check_step(self, model: str, step: int) -> None:
        """A push may target a step above the latest, or an existing one (idempotent re-push)."""
        self._parts.check_not_waiting(model, step)
        latest = self._index.latest(model)
        if latest is not None and step < latest and self._index.find(model, step) is None:
            raise FailedPrecondition(
                f"model {model!r}: step {step} is not above the latest version {latest}",
                reason="step_not_above_latest",
            )

    def residual(self, model: str, format: str, scaling: str, groups: Mapping[str, Group] | None = None) -> Residual:
        """The EF residual an `ef` push of `model` continues from: the one of the latest committed
        version if that version was an `ef` export to the same format, else a fresh (zero) one.

        Sharded (`groups`: each pushed tensor's owners): a tensor's residual goes on only if the
        latest version's holders of it are its owners now; else it starts afresh. Every owner of a
        tensor decides the same from the same manifest, so the owners' residuals stay equal, also
        when a replica was left out of a version or the replicas changed."""
        r = self._residuals.get(model)
        latest = self._index.latest(model)
        if r is None or latest is None or r.version != latest or (r.format, r.scaling) != (format, scaling):
            return Residual(format=format, scaling=scaling)
        if groups is None:
            return r
        held = self._index.find(model, latest)
        if held is None or not held.manifest.parts:
            return Residual(format=format, scaling=scaling)
        holders = holders_by_tensor(held.manifest)
        # (a tensor served packed is held under its elements' name)
        kept = {n: a for n, a in r.tensors.items()
                if n in groups and holders.get(n, holders.get(n + PACKED_SUFFIX)) == groups[n]}
        return Residual(version=r.version, tensors=kept, format=r.format, scaling=r.scaling)

    async def commit(
        self,
        version: Version,
        residual: tuple[int | None, Residual, VersionFile | None] | None = None,
        lag_input: tuple[Sample, int, bool] | None = None,
        part_of: PartOf | None = None,
    ) -> tuple[Version, bool]:
        """Make `version` visible (with an `ef` push, also its residual, given with the version of the
        residual it started from and the file it was staged in, if it was). Returns (the committed version, created).

        With `part_of`, `version` is this replica's part of a version of sharded replicas: it becomes
        visible when every owner's part is in, or is withdrawn after `part_of.timeout` seconds or once
        `part_of.abandoned` is set, and nothing of it stays.

        Runs to the end even if the pushing stream is cancelled meanwhile: once the file is in
        place the version must also be in memory, or a restart would resurrect a push that the
        learner saw fail.
        """
        if part_of is not None:
            self._parts.check_not_waiting(version.manifest.model, version.manifest.version)
        task = asyncio.ensure_future(self._commit(version, residual, lag_input, part_of))
        self._committing.add(task)
        task.add_done_callback(self._committing.discard)
        return await asyncio.shield(task)

    async def _commit(
        self,
        version: Version,
        residual: tuple[int | None, Residual, VersionFile | None] | None,
        lag_input: tuple[Sample, int, bool] | None,
        part_of: PartOf | None,
    ) -> tuple[Version, bool]:
        if part_of is not None:  # the file holds the part alone
            version = self._parts.own(version)
        m = version.manifest
        async with self._locks.setdefault(m.model, asyncio.Lock()):
            existing = self._index.find(m.model, m.version)
            latest = self._index.latest(m.model)
            # Checked here first too: a rejected push must not overwrite this server's files.
            if not check_commit(m.model, m.version, m.master_digest, existing.digest if existing else None, latest):
                assert existing is not None
                return existing, False
            if residual is not None and residual[0] != latest:
                raise FailedPrecondition(
                    f"model {m.model!r} step {m.version}: version {latest} committed while this ef push "
                    f"continued from version {residual[0]}; push again",
                    reason="step_not_above_latest",
                )
            tracker = self._lag.setdefault(m.model, LagTracker())
            before = tracker.snapshot()
            if lag_input is not None:  # the lag metrics go into the manifest, so into the file too
                m = dataclasses.replace(m, lag=tracker.observe(m.version, *lag_input))
            # The manifest's JSON (for the file's header and the registry) and the header, from the
            # final manifest: once each, off the loop (0.25 s and 0.35 s at 100,000 tensors).
            text = await asyncio.to_thread(m.json)
            header = await asyncio.to_thread(m.safetensors_header, text)
            version = dataclasses.replace(version, manifest=m, header=header)
            try:
                check_header_size(len(version.header) - 8, f"model {m.model!r} step {m.version}")
                if self._files is not None:
                    # Durable before visible: a version reported committed survives a crash. The
                    # residual goes first, named by its version, so a restart pairs it correctly.
                    if residual is not None:
                        write = functools.partial(self._files.write_residual, m.model, residual[1], residual[2])
                        await self.on_disk(m.model, m.version, write, locked=True)
                        crash_point("commit.residual-written")
                    # Served from its file now.
                    version = await self.on_disk(m.model, m.version, functools.partial(self._files.write, version),
                                                 locked=True)
                    crash_point("commit.version-renamed")
                # The registry decides (with Redis, across replicas) and announces the version.
                if part_of is None:
                    decided = await self._registered(m, text)
                else:
                    decided, version = await self._parts.commit(version, part_of, text)
            except BaseException:
                self._lag[m.model] = before
                if self._files is not None:
                    await asyncio.to_thread(self._files.remove, m.model, m.version, residual is not None)
                raise
            # Committed meanwhile (by another replica, or by an earlier try of this push whose answer
            # was lost): what this server holds of it is served from now on.
            held = self._index.find(m.model, m.version)
            if not decided.created and held is not None:
                return held, False
            created = decided.created or part_of is not None
            evicted = self._index.add(version)
            self._acks.committed(m.model, m.version, m.committed_unix)
            if residual is not None:
                self._residuals[m.model] = residual[1]
        self._metrics.versions_committed.labels(m.model).inc()
        if m.lag is not None:
            self._metrics.observe_lag(m.model, m.format, m.rounding, m.lag)
        await self._index.announce()
        crash_point("commit.visible")
        if self._files is not None and (evicted or residual is not None):
            # Outside the lock, so the next commit may be writing its residual meanwhile: bounded by
            # the latest version, the prune leaves that file alone.
            kept, latest = self._kept_residual(m.model), self._index.latest(m.model)
            await asyncio.to_thread(self._files.prune, m.model, evicted, kept, latest)
        return version, created

    async def _registered(self, m: Manifest, text: str) -> CommitResult:
        """Commit `m` in the registry. One that does not answer may have committed all the same (a
        timeout after its script ran): it is asked whether it holds this very content before the
        commit counts as failed, so the file of a version it announced is never deleted."""
        try:
            return await self._register(m, text)
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

    async def _register(self, m: Manifest, text: str | None = None) -> CommitResult:
        raw = text if text is not None else await asyncio.to_thread(m.json)
        return await self._registry.commit(m.model, m.version, m.master_digest, raw, self._index.retain)

    async def follow(self) -> None:
        """Sharded replicas: show every version the registry commits, also one this replica holds no
        part of (it was down, or left out of the push): it serves its manifest, and clients fetch
        the bytes from the replicas that hold them. A replica that returns thus catches up at once."""
        following: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                try:
                    for model in await self._registry.models():
                        if model not in following or following[model].done():
                            following[model] = asyncio.create_task(self._follow(model), name=f"follow-{model}")
                except Unavailable:
                    pass  # the registry is away: the models it knows are followed once it is back
                await asyncio.sleep(FOLLOW_MODELS_S)  # (no event announces a new model)
        finally:
            for task in following.values():
                task.cancel()

    async def catch_up(self, model: str | None = None) -> None:
        """Show now every version the registry committed above what this replica shows (of `model`,
        or of every model): before it joins the topology, and before a sharded push exports, so that
        it decides from the latest version (which ef residuals go on) as the other owners do."""
        for m in [model] if model is not None else await self._registry.models():
            latest = self._index.latest(m)
            for v in await self._registry.versions(m):
                if (latest is None or v > latest) and self._index.find(m, v) is None:
                    await self._learn(m, v, held_too=True)

    async def _follow(self, model: str) -> None:
        while True:
            try:
                async for v in self._registry.events(model, -1):
                    if self._index.find(model, v) is None:
                        await self._learn(model, v)
            except Unavailable:
                await asyncio.sleep(1.0)

    async def _learn(self, model: str, v: int, held_too: bool = False) -> None:
        """Show version `v`, which the registry committed, if this replica holds no part of it (or,
        `held_too`, if it shows nothing of it: its part's file was lost)."""
        raw = await self._registry.manifest(model, v)
        if raw is None:
            return
        whole = await asyncio.to_thread(manifest_from_registry, raw, f"model {model!r} version {v}")
        if not whole.parts:
            return  # one server holds it whole: clients pull it there
        if not held_too and self._parts.replica_id in {h for p in whole.parts for h in p.sources}:
            return  # this replica holds a part: its own commit (or restore) shows the version
        header = await asyncio.to_thread(whole.safetensors_header)
        nothing = dataclasses.replace(whole, tensors=(), data_bytes=0, parts=())
        version = Version(whole, header, memoryview(b""), part=nothing)
        async with self._locks.setdefault(model, asyncio.Lock()):
            if self._index.find(model, v) is not None:
                return  # its own commit showed it meanwhile
            self._index.add(version)
            self._acks.committed(model, v, whole.committed_unix)
        log.info("model %s version %d: committed without this replica; served from the replicas that hold it",
                 model, v)
        await self._index.announce()

    async def on_disk(self, model: str, step: int, write: Callable[[], T], *, locked: bool = False) -> T:
        """Run `write` (blocking I/O putting a file of `step` in the data dir) in a worker thread. If the
        disk is full, the model's oldest versions that nothing needs make room (`_make_room`), and it
        runs once more. `locked`: the caller holds the model's lock (a commit)."""
        try:
            return await asyncio.to_thread(write)
        except DiskFull as e:
            full = e
        async with contextlib.nullcontext() if locked else self._locks.setdefault(model, asyncio.Lock()):
            evicted = await self._make_room(model, step, full)
            try:
                return await asyncio.to_thread(write)
            except DiskFull as again:
                raise DiskFull(f"{again.message}, after evicting {_named(evicted)} of model {model!r}",
                               needed=again.needed) from None

    async def _make_room(self, model: str, step: int, full: DiskFull) -> list[int]:
        """Evict the model's oldest versions, deleting their files, until `full.needed` bytes are free
        (or, under a quota the free space does not show, were freed). The latest version stays (an ef
        push continues from it), and so does one that a pull holds (its blocks stay taken until the
        pull ends). Nothing goes when all that may go would not make room. Returns the versions evicted."""
        assert self._files is not None
        files, latest = self._files, self._index.latest(model)
        retained = self._index.versions(model) if latest is not None else []
        victims = [v.manifest.version for v in retained if v.manifest.version not in (latest, step) and not v.readers]
        kept = "the latest version and versions being pulled stay"
        if not victims:
            raise DiskFull(f"{full.message}; no version of model {model!r} may go to make room ({kept})",
                           needed=full.needed)
        sizes = await asyncio.to_thread(lambda: [files.allocated(model, v) for v in victims])
        free = await asyncio.to_thread(files.free_bytes)
        if free + sum(sizes) < full.needed:
            raise DiskFull(f"{full.message}; evicting {_named(victims)} would free only {sum(sizes):,} bytes, "
                           f"so none was evicted ({kept})", needed=full.needed)
        evicted: list[int] = []
        freed = 0
        for v, size in zip(victims, sizes, strict=True):
            if evicted and (free >= full.needed or freed >= full.needed):
                break
            version = self._index.find(model, v)
            if version is None or version.readers:  # gone meanwhile, or a pull started
                continue
            try:  # the file first: from here on a restart does not bring the version back
                await asyncio.to_thread(files.evict, model, v)
            except OSError as e:
                log.error("model %s version %d: cannot delete its file to make room: %s", model, v, e)
                break
            self._index.drop(model, [v])
            evicted.append(v)
            freed += size
            free = await asyncio.to_thread(files.free_bytes)
        if evicted:
            log.warning("model %s: the data dir is full: evicted %s (%d bytes) to make room for version %d",
                        model, _named(evicted), freed, step)
        return evicted

    def _kept_residual(self, model: str) -> int | None:
        """The version whose residual file is the model's current ef state (the others go)."""
        r = self._residuals.get(model)
        return None if r is None else r.version

    def restore(self) -> int:
        """Load committed versions from the data dir; returns how many. Skips damaged files."""
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
                self._residuals[model] = residual
            self._files.prune(model, evicted, self._kept_residual(model))
            count += len(versions)
        self._metrics.damaged_files.set(len(self._files.damaged))
        return count

    async def sync_registry(self) -> None:
        """After a restart, make the registry and the restored versions agree. A version the registry
        never committed (a crash between the file and the registry) above its latest is dropped; one
        below its latest that it does not know (it lost its data) is given back to it, and dropped
        only if retention leaves it out or the registry holds other content under its number; a
        registry that knows nothing of a model (a fresh one, or the embedded one) takes the files."""
        for model in self._index.models():
            known = await self._registry.versions(model)
            dropped = []
            for version in self._index.versions(model):
                v = version.manifest.version
                if version.manifest.parts:  # a part: served again only as part of what the registry holds
                    whole = await self._parts.restored(version)
                    if whole is None:
                        dropped.append(v)
                    else:
                        self._index.add(whole)
                    continue
                if v in known:
                    continue
                if known and v > known[-1]:
                    dropped.append(v)
                    continue
                if known:  # below its latest: the registry lost it (its data), or retention let it go
                    m = version.manifest
                    try:
                        text = await asyncio.to_thread(m.json)
                        if not await self._registry.restore(model, v, m.master_digest, text, self._index.retain):
                            dropped.append(v)  # older than what retention keeps
                    except AlreadyExists:
                        dropped.append(v)  # the registry holds other content under that number
                    continue
                try:
                    await self._register(version.manifest)
                except (AlreadyExists, FailedPrecondition):
                    dropped.append(v)  # retired meanwhile, or replaced: the registry decides
            for v in dropped:
                log.warning("model %s version %d: restored, but not committed in the registry; dropped", model, v)
            self._index.drop(model, dropped)
            if dropped and self._files is not None:
                await asyncio.to_thread(self._files.prune, model, dropped, self._kept_residual(model))


def _named(versions: list[int]) -> str:
    return f"version{'s' if len(versions) > 1 else ''} {', '.join(map(str, versions))}" if versions else "no version"
