"""The transport-agnostic core: the service's parts, wired, and the calls of the transports that
take more than one of them.

The gRPC servicer and the HTTP routes translate their requests into calls and the domain errors
back; nothing about versions, export or metrics lives in them. They call the part that owns a call
when one does: `pushes` (the push package, push/), `pulls` (pull.py), `index` (the committed
versions), `acks`; and the service for the rest (listings, watches, topology, clients). Below this
module nothing holds the service: a push gets a `PushContext` of exactly what it needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import overload

from weightsvc import rounding
from weightsvc.errors import (
    DataLoss,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from weightsvc.metrics import Metrics
from weightsvc.protocol.manifest import Manifest, check_manifest
from weightsvc.protocol.refs import check_model_name
from weightsvc.protocol.topology import Replica
from weightsvc.service.device import Exporter, exporter_for
from weightsvc.service.publish import Publisher
from weightsvc.service.pull import Pulls, Watches, events
from weightsvc.service.push.context import PushContext
from weightsvc.service.push.pushes import Pushes
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.replicas.redis import RedisRegistry
from weightsvc.service.replicas.registry import Registry
from weightsvc.service.versions.acks import Acks, ClientStatus
from weightsvc.service.versions.commit import Committer
from weightsvc.service.versions.disk import DamagedFile, VersionFiles
from weightsvc.service.versions.index import Version, VersionIndex
from weightsvc.service.versions.mismatch import Mismatches, Reported
from weightsvc.settings import Settings

log = logging.getLogger("weightsvc.service")


@dataclass(frozen=True)
class ModelSummary:
    model: str
    latest_version: int
    versions: list[int]  # retained, oldest first


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
    """The core shared by every transport: settings, metrics, the versions' parts, the pushes, the
    pulls and the export workers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.metrics = Metrics()
        # A relay keeps a registry of its own whatever its environment: in the shared one it would be
        # taken for a shard, and every push would be sent to it. The registry decides commits and
        # carries events and acks; the index holds the bytes.
        shared = None if settings.relay_from else settings.redis_url
        self.registry: Registry = RedisRegistry(shared, prefix=settings.redis_prefix) if shared else MemoryRegistry()
        self.index = VersionIndex(settings.retain, self.metrics)
        self.index.pool.max_bytes = settings.max_staged_bytes  # reusable buffers count in the staging budget
        self.files = VersionFiles(settings.data_dir) if settings.data_dir is not None else None
        self.parts = Parts(self.registry, settings.retain)
        self.acks = Acks(self.index, self.registry, self.metrics)
        self.acks.forget_s = settings.client_forget_s
        self.mismatches = Mismatches(self.index, self.registry, self.metrics)
        self.committer = Committer(index=self.index, files=self.files, parts=self.parts, acks=self.acks,
                                   registry=self.registry, metrics=self.metrics)
        # Where pushes export (`--device`): refused here, before anything listens, when it cannot be had.
        self.exporter = exporter_for(settings.device, self.metrics.gpu_staged_bytes.inc)
        self.exporter.resident_max = settings.gpu_residual_bytes
        self.exporter.resident_bytes = self.metrics.gpu_residual_bytes.inc
        self.exporter.residual_found = lambda source: self.metrics.gpu_residual_chunks.labels(source).inc()
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
        self._topology: list[Replica] | None = None  # the last the registry gave (before it lost its data)
        self.replica: Replica | None = None  # this replica, once it registered (sharded replicas)
        self.watches = Watches(settings.watch_limit, self.metrics)
        self.publisher = Publisher(settings, self.metrics, self.index) if settings.object_store else None
        self.committer.publisher = self.publisher

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
        """The files of `model` (of every model: None) that restore found damaged and set aside."""
        files = self.files
        return [d for d in (files.damaged if files is not None else []) if model is None or d.model == model]

    async def mirror(self, manifest: Manifest, data: memoryview) -> None:
        """Commit a version pulled (and verified) from an upstream, as it is: a relay's commit. A
        version of sharded replicas is whole here: the relay serves all of it. What the upstream sent
        is checked again here, against this server's limits, before anything touches the disk."""
        s = self.settings
        await asyncio.to_thread(check_manifest, manifest, max_bytes=s.max_version_bytes, max_tensors=s.max_tensors)
        if len(data) != manifest.data_bytes:
            raise DataLoss(f"model {manifest.model!r} version {manifest.version}: {len(data)} bytes of data for a "
                           f"data section of {manifest.data_bytes}")
        held = self.index.models()
        if manifest.model not in held and len(held) >= s.max_models:
            raise ResourceExhausted(f"model {manifest.model!r} version {manifest.version}: this server holds "
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
        """The replicas as the registry knows them; while it is unreachable, as it last knew them
        (clients keep pulling from the owners; pushes fail at their commit, with UNAVAILABLE). A
        registry that no longer knows this replica lost its data: this replica registers again, and
        until every replica had the time to (`REPLICA_TTL_S`), the topology is also what it was before."""
        try:
            live = await self.registry.replicas()
            if self.replica is not None and self.replica not in live:
                await self.registry.register(self.replica)
                self.registry_lost()
                live = sorted({*live, self.replica})
        except Unavailable:
            if self._topology is None:
                raise
            return self._topology
        if self.parts.recovering():  # so that no push goes to fewer owners than hold each tensor
            return sorted({*live, *(self._topology or [])})
        self._topology = live
        self.parts.replicas_seen = len(live)
        return live

    def registry_lost(self) -> None:
        """The registry lost its data (this replica's registration vanished): the topology holds what
        it was for a while, and this replica gives the registry back the versions it holds."""
        log.warning("the registry lost this replica's registration (its data): registered again; giving it back "
                    "the versions held here")
        self.committer.registry_lost()

    def clients(self, model: str) -> list[ClientStatus]:
        """The clients that acked a version of `model`: what each holds, how far behind, whether it is
        still around (NOT_FOUND for an unknown model, as every model read)."""
        self.index.get(model, None)
        return self.acks.clients(model)
