"""The data plane: the one façade every transport calls, the parts it builds, and the order they
start and stop in.

The gRPC servicer and the HTTP routes translate their requests into one call of `Service` each and
its domain errors back; the requests and answers are `api`'s types. Nothing about versions, export or
metrics lives in a transport, and no transport names a part below this module: a push is `push`
(the push package, push/), a pull `open_pull` (pull.py), and so on. Below this module nothing holds
the service: a push gets a `PushContext` of exactly what it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, overload

from weightsvc import rounding
from weightsvc.errors import (
    DataLoss,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    Unavailable,
    WeightsvcError,
    subject,
)
from weightsvc.metrics import Metrics
from weightsvc.protocol.fabric import Lease
from weightsvc.protocol.manifest import Manifest, check_manifest
from weightsvc.protocol.mismatch import RolloutMismatch
from weightsvc.protocol.published import RankPublish
from weightsvc.protocol.refs import check_model_name
from weightsvc.protocol.selection import Select
from weightsvc.protocol.topology import REPLICA_TTL_S, Replica
from weightsvc.service.api import ClientStatus, DamagedFile, ModelSummary, PushMessage, Reported
from weightsvc.service.copies.copies import Copies
from weightsvc.service.device import Exporter, exporter_for
from weightsvc.service.lender import Lender
from weightsvc.service.publish import Gather, Publisher, publishes
from weightsvc.service.publish import restore as restore_from_store
from weightsvc.service.pull import Pull, Pulls, Watches, events
from weightsvc.service.push.context import PushContext
from weightsvc.service.push.pushes import Pushes
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.replicas.redis import RedisRegistry
from weightsvc.service.replicas.registry import Registry, manifest_from_registry
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.commit import Committer
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.index import Version, VersionIndex
from weightsvc.service.versions.mismatch import Mismatches
from weightsvc.settings import Settings

log = logging.getLogger("weightsvc.service")


class _Changes:
    """Wakes coroutines that wait for the service's state to change; notified from the loop."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.add(waiter)
            await waiter


class Service:
    """The data plane: one method per call of the transports (push, publish, open a pull, manifest, watch,
    ack, report a mismatch, topology, listings) over the parts it builds; `start` and `stop` own the
    order in which they come up and go down."""

    def __init__(self, settings: Settings, gather: Gather | None = None) -> None:
        """`gather`: a version of sharded replicas, whole (the server's client of the replicas), for
        the object store."""
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.metrics = Metrics()
        # A relay keeps a registry of its own whatever its environment: in the shared one it would be
        # taken for a shard, and every push would be sent to it. The registry decides commits and
        # carries events and acks; the index holds the bytes.
        shared = None if settings.relay_from else settings.redis_url
        self.registry: Registry = RedisRegistry(shared, prefix=settings.redis_prefix) if shared else MemoryRegistry()
        # Reusable buffers count in the staging budget.
        self.index = VersionIndex(settings.retain, self.metrics, pool_bytes=settings.max_staged_bytes)
        self.files = VersionFiles(settings.data_dir) if settings.data_dir is not None else None
        self.parts = Parts(self.registry, settings.retain)
        self.acks = Acks(self.index, self.registry, self.metrics, forget_s=settings.client_forget_s)
        self.mismatches = Mismatches(self.index, self.registry, self.metrics)
        self.publisher = Publisher(settings, self.metrics, self.index, gather) if settings.object_store else None
        self.committer = Committer(index=self.index, files=self.files, parts=self.parts, acks=self.acks,
                                   registry=self.registry, metrics=self.metrics, publisher=self.publisher)
        # Where pushes export (`--device`): refused here, before anything listens, when it cannot be had.
        self.exporter = exporter_for(
            settings.device, self.metrics.gpu_staged_bytes.inc, resident_max=settings.gpu_residual_bytes,
            resident_bytes=self.metrics.gpu_residual_bytes.inc,
            residual_found=lambda source: self.metrics.gpu_residual_chunks.labels(source).inc())
        # One export at a time, its kernels on one thread (why: `rounding.use_threads`).
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="weightsvc-export", initializer=rounding.use_threads, initargs=(1,)
        )
        self._changes = _Changes()
        self.pushes = Pushes(PushContext(
            settings=settings, metrics=self.metrics, executor=self.executor, loop=self.loop,
            exporter=self.current_exporter, pool=self.index.pool, files=self.files, committer=self.committer,
            parts=self.parts, index=self.index, changed=self.changed,
        ))
        self.pulls = Pulls(settings, self.metrics, self.index, self.parts, self.changed)
        # --nixl: versions lent over the fabric (refused here, before anything listens, without NIXL).
        self.lender = Lender(settings, self.metrics, self._open_lent) if settings.nixl else None
        # Publishes: copied in with the lender's agent, staged within the pushes' budget.
        self.copies = Copies(settings, self.metrics, committer=self.committer, index=self.index, pool=self.index.pool,
                             budget=self.pushes.budget, lender=self._copier)
        self.membership = Membership(self.registry, self.parts, self.committer)
        self.watches = Watches(settings.watch_limit, self.metrics)
        self._heartbeat: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None

    # ---- start and stop ----------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        """This replica holds parts of versions with others (a relay keeps a registry of its own)."""
        return bool(self.settings.redis_url) and not self.settings.relay_from

    async def start(self, listen: Callable[[], Awaitable[Replica]]) -> None:
        """Bring the service up: the versions of the data dir, the registry's view of them, the object
        store; then `listen` (the transports serve from there on, and say where: this replica); then
        this replica takes part: it catches up with the versions committed without it, registers,
        and follows the others' commits."""
        restored = await asyncio.to_thread(self.committer.restore)
        if restored:
            log.info("restored %d committed versions from %s", restored, self.settings.data_dir)
        await self.committer.sync_registry()
        await _start_publisher(self)
        replica = await listen()
        self.parts.replica_id = replica.id  # (its id names the ports it listens on: known only now)
        if self.sharded:
            await self.committer.follower.catch_up()  # before it takes part in pushes
        await self.registry.register(replica)
        if self.sharded:
            self.membership.replica = replica  # (its registration vanishing tells a registry that lost its data)
        self._heartbeat = asyncio.create_task(self.membership.renew(replica), name="heartbeat")
        if self.sharded:
            self._follow = asyncio.create_task(self.committer.follower.follow(), name="follow")

    async def stop(self, close: Callable[[], Awaitable[None]]) -> None:
        """`start` in reverse: this replica leaves the registry, the watches end (an open stream would
        hold up the transports' shutdown), `close` stops the transports, then the uploads, the export
        workers and the registry's connection."""
        for task in (self._heartbeat, self._follow):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        replica_id = self.parts.replica_id
        self.membership.replica = None  # (gone from the registry now, not to register again)
        if replica_id:
            with contextlib.suppress(WeightsvcError):
                await self.registry.deregister(replica_id)
        self.end_watches()
        await close()
        if self.lender is not None:
            self.lender.close()
        if self.publisher is not None:
            await self.publisher.stop()
        await asyncio.to_thread(self.close)
        await self.registry.close()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    # ---- pushes and pulls in progress ---------------------------------------------------------

    def changed(self) -> None:
        """Wake whoever waits in `wait_for`: a push or a pull started or ended."""
        self._changes.notify()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; re-checked whenever a push or a pull starts or ends."""
        await self._changes.wait_for(predicate)

    async def wait_pushes(self, count: int) -> None:
        """Return once exactly `count` staging sessions are open (0: every staging buffer released)."""
        await self.wait_for(lambda: len(self.pushes.sessions) == count)

    # ---- pushes and pulls -----------------------------------------------------------------------

    async def push(self, messages: AsyncIterator[PushMessage]) -> tuple[Manifest, bool]:
        """One rank's push stream (header, chunks, commit): the committed version's manifest, and
        whether this push created it (False: the same version was pushed before)."""
        version, created = await self.pushes.run(messages)
        return version.manifest, created

    async def open_pull(self, model: str, version: int | None, transport: str, *, base: int | None = None,
                        dense_fallback: bool = True, select: Select | None = None) -> Pull:
        """A pull of `version` (None: the latest), holding it until `Pull.close`: its pieces, in memory
        or in the version's file, sent under the stall timeout (`Pulls.open`)."""
        return await self.pulls.open(model, version, transport, base=base, dense_fallback=dense_fallback,
                                     select=select)

    async def lease(self, model: str, version: int | None, select: Select | None, lease_s: float,
                    base: int | None = None) -> Lease:
        """Lend `version` (None: the latest) over NIXL for `lease_s` seconds: the agent's metadata and
        where each tensor, or each selected slice, lies in its registered memory; with `base`, where the
        delta encoding against it lies, when there is one (`Lender.lease`)."""
        return await self._lender().lease(model, version, select, lease_s, base)

    def lent(self, lease_id: str) -> Lease:
        """A lease held now (NOT_FOUND if none of that id is)."""
        return self._lender().lent(lease_id)

    def release_lease(self, lease_id: str) -> None:
        """A reader is done with its lease (DEADLINE_EXCEEDED when it expired first: `Lender.release`)."""
        self._lender().release(lease_id)

    async def publish(self, request: RankPublish) -> tuple[Manifest, bool]:
        """A learner rank's publish (`serve --nixl`): its part of a served copy it exported, READ from its
        memory once every rank is in, checked and committed (`Copies.run`). Returns once the version
        commits: its manifest, and whether this publish created it."""
        version, created = await self.copies.run(request)
        return version.manifest, created

    def _copier(self) -> Lender:
        if self.lender is None:
            raise FailedPrecondition("this server READs no publish over NIXL (it runs without --nixl): serve with "
                                     "--nixl, or push the masters", reason="nixl_off")
        return self.lender

    def _lender(self) -> Lender:
        if self.lender is None:
            raise FailedPrecondition("this server lends no version over NIXL (it runs without --nixl): pull over "
                                     "gRPC or HTTP", reason="nixl_off")
        return self.lender

    async def _open_lent(self, model: str, version: int | None, select: Select | None, base: int | None) -> Pull:
        return await self.pulls.open(model, version, "nixl", select=select, base=base, in_place=True)

    def manifest(self, model: str, version: int | None) -> Manifest:
        """The manifest of a retained version (None: the latest)."""
        return self.index.get(model, version).manifest

    async def ack(self, model: str, version: int, client_id: str, caller: str) -> int:
        """A client holds `version`: the latest version, for it to compare."""
        return await self.acks.ack(model, version, client_id, caller)

    async def report_mismatch(self, model: str, versions: Mapping[Any, Mapping[str, Any]], step: int | None
                              ) -> dict[int, RolloutMismatch]:
        """A learner's report of the trainer-rollout mismatch per version: the totals so far."""
        return await self.mismatches.report(model, versions, step)

    # ---- reads -------------------------------------------------------------------------------

    def models(self) -> list[ModelSummary]:
        out = []
        for model in self.index.models():
            versions = [v.manifest.version for v in self.index.versions(model)]
            out.append(ModelSummary(model, versions[-1], versions))
        return out

    def versions(self, model: str) -> list[Manifest]:
        try:
            return [v.manifest for v in self.index.versions(model)]
        except NotFound as e:
            damaged = self.damaged_files(model)
            if not damaged:
                raise
            raise NotFound(f"{e.message}; {len(damaged)} damaged file(s) of it were set aside at start-up: "
                           + "; ".join(f"{d.file} ({d.reason})" for d in damaged)) from None

    async def listed_versions(self, model: str) -> list[tuple[Manifest, Reported | None]]:
        """The retained versions with the mismatch reported for each (none while the registry is away:
        the listing does not wait for it)."""
        manifests = self.versions(model)
        try:
            reported = await self.mismatches.listing(model)
        except Unavailable as e:
            log.warning("version listing without the reported mismatch: %s", e)
            reported = {}
        return [(m, reported.get(m.version)) for m in manifests]

    def damaged_files(self, model: str | None = None) -> list[DamagedFile]:
        """The files of `model` (of every model: None) that restore found damaged and set aside: of the
        data dir, and of the object store (named by their URL)."""
        found = list(self.files.damaged) if self.files is not None else []
        if self.publisher is not None:
            url = self.publisher.url
            found += [DamagedFile(d.model, f"{url}/{d.name}", d.reason) for d in self.publisher.damaged]
        return [d for d in found if model is None or d.model == model]

    async def mirror(self, manifest: Manifest, data: memoryview) -> None:
        """Commit a version pulled (and verified) from an upstream, as it is: a relay's commit. A
        version of sharded replicas is whole here: the relay serves all of it. What the upstream sent
        is checked again here, against this server's limits, before anything touches the disk."""
        s = self.settings
        await asyncio.to_thread(check_manifest, manifest, max_bytes=s.max_version_bytes, max_tensors=s.max_tensors)
        if len(data) != manifest.data_bytes:
            raise DataLoss(f"{subject(manifest.model, manifest.version)}: {len(data)} bytes of data for a "
                           f"data section of {manifest.data_bytes}")
        held = self.index.models()
        if manifest.model not in held and len(held) >= s.max_models:
            raise ResourceExhausted(f"{subject(manifest.model, manifest.version)}: this server holds "
                                    f"{len(held)} models, the most it takes (--max-models {s.max_models})",
                                    reason="too_many")
        manifest = dataclasses.replace(manifest, parts=())
        await self.committer.commit(Version(manifest, b"", data))  # its header is made at commit

    @overload
    def watch(self, model: str, after: int | None) -> AsyncIterator[Manifest]: ...

    @overload
    def watch(self, model: str, after: int | None, *, idle: float) -> AsyncIterator[Manifest | None]: ...

    def watch(self, model: str, after: int | None, *, idle: float | None = None) -> AsyncIterator[Manifest | None]:
        """Every retained version above `after` (all when None), then each new one as it commits. With
        `idle`, None after each `idle` seconds without one (for a transport's keepalive). Ends with
        UNAVAILABLE when the server stops (`end_watches`) or newer watches take its place (`Watches`)."""
        check_model_name(model)  # here, not at the first event: a transport answers the error itself
        return self.watches.follow(events(self.registry, self.index, model, after), idle)

    def end_watches(self) -> None:
        """The server is stopping: every watch stream ends now rather than hold up the shutdown."""
        self.watches.stopping.set()

    def current_exporter(self) -> Exporter:
        """The exporter a new push exports with: after a GPU error, the CPU's from then on."""
        if self.exporter.failed:
            log.warning("the export on %s failed: pushes export on the CPU from now on", self.exporter.name)
            self.exporter = Exporter("cpu", "", self.exporter.staged)  # (its resident residuals go with the old)
            self.metrics.gpu_residual_bytes.set(0)
        return self.exporter

    async def topology(self) -> list[Replica]:
        """The replicas as the registry knows them (`Membership.topology`)."""
        return await self.membership.topology()

    @property
    def device(self) -> str:
        """Where pushes export (`Exporter.name`): what the ready line and /readyz say."""
        return self.exporter.name

    def latest(self, model: str) -> int | None:
        """The latest retained version of `model`, None when none is."""
        return self.index.latest(model)

    def held_models(self) -> list[str]:
        """The models this server retains a version of."""
        return self.index.models()

    def committed(self, model: str, version: int) -> tuple[Manifest, memoryview] | None:
        """A retained version's manifest and data section (with a data dir: its file's pages), or None."""
        found = self.index.find(model, version)
        return None if found is None else (found.manifest, found.data)

    def clients(self, model: str) -> list[ClientStatus]:
        """The clients that acked a version of `model`: what each holds, how far behind, whether it is
        still around (NOT_FOUND for an unknown model, as every model read)."""
        self.index.get(model, None)
        return self.acks.clients(model)


async def _start_publisher(service: Service) -> None:
    """--object-store: a server that starts with no versions (an empty or no data dir) first brings
    back those the store retains; one that has versions queues them (those in the store already are
    skipped); then uploads begin."""
    publisher = service.publisher
    if publisher is None:
        return
    await publisher.open()
    if not service.index.models():
        wanted = functools.partial(_restorable, service.registry) if service.sharded else None
        restored = await restore_from_store(publisher, service.settings, service.mirror, wanted)
        log.info("restored %d committed versions from the object store %s", restored, publisher.url)
        service.metrics.damaged_files.set(len(service.damaged_files()))
    else:  # what the data dir holds and the store does not (uploads a stop or a crash cut off) goes up
        for model in service.index.models():
            for version in service.index.versions(model):
                if version.part is None or publishes(version):
                    publisher.committed(version)
    publisher.start()


async def _restorable(registry: Registry, m: Manifest) -> bool:
    """Whether a sharded replica brings back version `m` from the store (whole, as a relay holds one):
    when the registry knows nothing of it and nothing newer (a fresh cluster), or holds it whole with
    the same content (another replica brought it back first). One it holds in parts is served by
    their holders; one below its latest that it does not hold is retired."""
    raw = await registry.manifest(m.model, m.version)
    if raw is None:
        known = await registry.versions(m.model)
        return not known or m.version > known[-1]
    held = await asyncio.to_thread(manifest_from_registry, raw, subject(m.model, m.version))
    return not held.parts and held.master_digest == m.master_digest


class Membership:
    """This replica in the registry: its registration, kept alive, and the topology as the registry
    last gave it (what clients are told while the registry is away, or after it lost its data)."""

    def __init__(self, registry: Registry, parts: Parts, committer: Committer) -> None:
        self.registry, self.parts, self.committer = registry, parts, committer
        self.replica: Replica | None = None  # this replica, once it registered (sharded replicas)
        self._last: list[Replica] | None = None  # the last the registry gave (before it lost its data)

    async def topology(self) -> list[Replica]:
        """The replicas as the registry knows them; while it is unreachable, as it last knew them
        (clients keep pulling from the owners; pushes fail at their commit, with UNAVAILABLE). A
        registry that no longer knows this replica lost its data: this replica registers again, and
        until every replica had the time to (`REPLICA_TTL_S`), the topology is also what it was before."""
        try:
            live = await self.registry.replicas()
            if self.replica is not None and self.replica not in live:
                await self.registry.register(self.replica)
                self.lost()
                live = sorted({*live, self.replica})
        except Unavailable:
            if self._last is None:
                raise
            return self._last
        if self.parts.recovering():  # so that no push goes to fewer owners than hold each tensor
            return sorted({*live, *(self._last or [])})
        self._last = live
        self.parts.replicas_seen = len(live)
        return live

    def lost(self) -> None:
        """The registry lost its data (this replica's registration vanished): the topology holds what
        it was for a while, and this replica gives the registry back the versions it holds."""
        log.warning("the registry lost this replica's registration (its data): registered again; giving it back "
                    "the versions held here")
        self.committer.registry_lost()

    async def renew(self, replica: Replica) -> None:
        """Keep this replica's registration alive (it expires if the process dies)."""
        while True:
            await asyncio.sleep(REPLICA_TTL_S / 3)
            try:
                if not await self.registry.register(replica) and self.replica is not None:
                    self.lost()  # it forgot this replica: it lost its data, or was away too long
                await self.topology()  # (kept fresh: what the topology was, should the registry lose it)
            except WeightsvcError as e:  # the registry is away: keep serving, try again
                log.warning("cannot renew replica %s: %s", replica.id, e)
