"""The transport-agnostic core: what happens on push, pull, list, watch and ack.

The gRPC servicer and the HTTP routes translate their requests into these calls and the domain
errors back; nothing about versions, export or metrics lives in them. A push's lifecycle is in
`core.push`, its staging and export in `core.staging`, committed versions in `core.store`.
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
    NotFound,
    Unavailable,
)
from weightsvc.metrics import Metrics
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.refs import check_model_name
from weightsvc.protocol.selection import Select
from weightsvc.protocol.topology import Replica
from weightsvc.service.device import Kernels, kernels_for
from weightsvc.service.pull import Pull, Pulls, watching
from weightsvc.service.push.pushes import Pushes, PushMessage
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.redis import RedisRegistry
from weightsvc.service.versions.disk import DamagedFile
from weightsvc.service.versions.store import ClientStatus, Version, VersionStore
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
    """The core shared by every transport: settings, store, metrics and the export workers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.metrics = Metrics()
        # A relay keeps a registry of its own whatever its environment: in the shared one it would be
        # taken for a shard, and every push would be sent to it.
        shared = None if settings.relay_from else settings.redis_url
        registry = RedisRegistry(shared, prefix=settings.redis_prefix) if shared else MemoryRegistry()
        self.store = VersionStore(
            retain=settings.retain, data_dir=settings.data_dir, metrics=self.metrics, registry=registry
        )
        self.store.pool.max_bytes = settings.max_staged_bytes  # reusable buffers count in the staging budget
        self.store.acks.forget_s = settings.client_forget_s
        # Where pushes export (`--device`): refused here, before anything listens, when it cannot be had.
        self.kernels = kernels_for(settings.device, self.metrics.gpu_staged_bytes.inc)
        self.kernels.resident_max = settings.gpu_residual_bytes
        self.kernels.resident_bytes = self.metrics.gpu_residual_bytes.inc
        # One export at a time, its kernels on one thread (why: `rounding.use_threads`).
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="weightsvc-export", initializer=rounding.use_threads, initargs=(1,)
        )
        self._changes = _Changes()
        self.pushes = Pushes(self)
        self.pulls = Pulls(self)
        self._topology: list[Replica] | None = None  # the last the registry gave
        self._stopping = asyncio.Event()  # set when the server stops: watches end

    def restore(self) -> int:
        return self.store.restore()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    # ---- push --------------------------------------------------------------------------------

    async def push(self, messages: AsyncIterator[PushMessage]) -> tuple[Version, bool]:
        """Run one push stream (`core.push`): nothing is visible unless it commits."""
        return await self.pushes.run(messages)

    def changed(self) -> None:
        """Wake whoever waits in `wait_for`: a push or a pull started or ended."""
        self._changes.notify()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; re-checked whenever a push or a pull starts or ends."""
        await self._changes.wait_for(predicate)

    async def wait_pushes(self, count: int) -> None:
        """Return once exactly `count` pushes are staged (0: every staging buffer released)."""
        await self.wait_for(lambda: len(self.pushes.sessions) == count)

    # ---- reads -------------------------------------------------------------------------------

    def models(self) -> list[ModelSummary]:
        out = []
        for model in self.store.models():
            versions = [v.manifest.version for v in self.store.versions(model)]
            out.append(ModelSummary(model, versions[-1], versions))
        return out

    def versions(self, model: str) -> list[Manifest]:
        try:
            return [v.manifest for v in self.store.versions(model)]
        except NotFound as e:
            damaged = self.damaged_files(model)
            if not damaged:
                raise
            raise NotFound(f"{e.message}; {len(damaged)} damaged file(s) of it were set aside at start-up: "
                           + "; ".join(f"{d.file} ({d.reason})" for d in damaged)) from None

    def damaged_files(self, model: str | None = None) -> list[DamagedFile]:
        """The files of `model` (of every model: None) that restore found damaged and set aside."""
        files = self.store.files
        return [d for d in (files.damaged if files is not None else []) if model is None or d.model == model]

    def manifest(self, model: str, version: int | None) -> Manifest:
        return self.store.get(model, version).manifest

    def latest(self, model: str) -> int:
        """The model's latest committed version (NOT_FOUND for a model without any)."""
        return self.store.get(model, None).manifest.version

    async def pull(self, model: str, version: int | None, transport: str, *, base: int | None = None,
                   select: Select | None = None) -> Pull:
        """Start a pull of `version` (None: the latest). With `base` (a version the client holds), the
        body is the delta encoding against it when there is one, else the data section as always. With
        `select`, only the selected tensors, whole or sliced, under the selection's own manifest."""
        return await self.pulls.open(model, version, transport, base, dense_fallback=True, select=select)

    async def pull_delta(self, model: str, version: int | None, base: int, transport: str) -> Pull:
        """Start a pull whose body is the delta encoding of `version` against `base`; FAILED_PRECONDITION
        saying why when there is none (the client then pulls the whole version)."""
        return await self.pulls.open(model, version, transport, base, dense_fallback=False)

    async def mirror(self, manifest: Manifest, data: memoryview) -> None:
        """Commit a version pulled (and verified) from an upstream, as it is: a relay's commit. A
        version of sharded replicas is whole here: the relay serves all of it."""
        manifest = dataclasses.replace(manifest, parts=())
        await self.store.commit(Version(manifest, b"", data))  # its header is made at commit

    @overload
    def watch(self, model: str, after: int | None) -> AsyncIterator[Manifest]: ...

    @overload
    def watch(self, model: str, after: int | None, *, idle: float) -> AsyncIterator[Manifest | None]: ...

    def watch(self, model: str, after: int | None, *, idle: float | None = None) -> AsyncIterator[Manifest | None]:
        """Every retained version above `after` (all when None), then each new one as it commits. With
        `idle`, None after each `idle` seconds without one (for a transport's keepalive). Ends with
        UNAVAILABLE when the server stops (`end_watches`)."""
        check_model_name(model)  # here, not at the first event: a transport answers the error itself
        return watching(self.store.watch(model, after), self._stopping, idle)

    def end_watches(self) -> None:
        """The server is stopping: every watch stream ends now rather than hold up the shutdown."""
        self._stopping.set()

    def ack(self, model: str, version: int, client_id: str) -> int:
        return self.store.ack(model, version, client_id)

    def export_kernels(self) -> Kernels:
        """The kernels a new push exports with: after a GPU error, the CPU's from then on."""
        if self.kernels.failed:
            log.warning("the export on %s failed: pushes export on the CPU from now on", self.kernels.name)
            self.kernels = Kernels("cpu", "", self.kernels.staged)  # (its resident residuals go with the old)
            self.metrics.gpu_residual_bytes.set(0)
        return self.kernels

    async def topology(self) -> list[Replica]:
        """The replicas as the registry knows them; while it is unreachable, as it last knew them
        (clients keep pulling from the owners; pushes fail at their commit, with UNAVAILABLE)."""
        try:
            self._topology = await self.store.registry.replicas()
        except Unavailable:
            if self._topology is None:
                raise
        return self._topology

    def clients(self, model: str) -> list[ClientStatus]:
        """The clients that acked a version of `model`: what each holds, how far behind, whether it is
        still around (NOT_FOUND for an unknown model, as every model read)."""
        self.latest(model)
        return self.store.clients(model)
