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

from weightsvc import rounding
from weightsvc.core.delta import compatible as delta_compatible
from weightsvc.core.delta import encode as delta_encode
from weightsvc.core.manifest import (
    Manifest,
    check_model_name,
)
from weightsvc.core.push import Pushes, PushMessage
from weightsvc.core.registry import MemoryRegistry, RedisRegistry
from weightsvc.core.store import ClientAck, Version, VersionStore
from weightsvc.core.topology import Replica
from weightsvc.errors import (
    NotFound,
    TooManyRequests,
    Unavailable,
)
from weightsvc.metrics import Metrics
from weightsvc.settings import Settings

log = logging.getLogger("weightsvc.service")

MAX_CACHED_DELTAS = 2  # each up to the size of its version: a fleet pulls (latest, its base)


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
        registry = (
            RedisRegistry(settings.redis_url, prefix=settings.redis_prefix) if settings.redis_url else MemoryRegistry()
        )
        self.store = VersionStore(
            retain=settings.retain, data_dir=settings.data_dir, metrics=self.metrics, registry=registry
        )
        # One export at a time, its kernels on one thread (why: `rounding.use_threads`).
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="weightsvc-export", initializer=rounding.use_threads, initargs=(1,)
        )
        self._pulls = 0  # pulls holding a version, against --max-pulls
        self._changes = _Changes()
        self.pushes = Pushes(self)
        self._deltas: dict[tuple[str, int, int], bytes | None] = {}  # recent delta encodings, oldest first
        self._topology: list[Replica] | None = None  # the last the registry gave

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
        return [v.manifest for v in self.store.versions(model)]

    def manifest(self, model: str, version: int | None) -> Manifest:
        return self.store.get(model, version).manifest

    def open_pull(self, model: str, version: int | None, transport: str) -> Version:
        """Hold a version for a pull; eviction cannot recycle its buffer until `close_pull`."""
        if transport != "delta" and self._pulls >= self.settings.max_pulls:
            raise TooManyRequests(
                f"{self._pulls} pulls in progress, the most this server takes (--max-pulls "
                f"{self.settings.max_pulls}); retry later",
                reason="too_many",
            )
        held = self.store.get(model, version)
        self.store.hold(held)
        self._pulls += transport != "delta"
        self.metrics.pulls_in_flight.labels(transport).inc()
        return held

    def close_pull(self, version: Version, transport: str) -> None:
        self.metrics.pulls_in_flight.labels(transport).dec()
        self._pulls -= transport != "delta"
        self.store.release(version)
        self._changes.notify()

    async def delta(self, version: Version, base: int | None) -> bytes | None:
        """The delta encoding of `version` against `base` of the same model, or None when the base is
        not retained, has another layout, or the delta would not be smaller than the dense bytes."""
        if base is None or base == version.manifest.version:
            return None
        key = (version.manifest.model, version.manifest.version, base)
        if key in self._deltas:  # a fleet pulls the same delta many times: encode it once
            return self._deltas[key]
        try:
            held = self.open_pull(version.manifest.model, base, "delta")
        except NotFound:
            return None
        try:
            if held.part is not None or not delta_compatible(held.manifest, version.manifest):
                return None
            encoded = await asyncio.to_thread(delta_encode, version.manifest, version.data, held.data)
        finally:
            self.close_pull(held, "delta")
        delta = encoded if len(encoded) < version.manifest.data_bytes else None
        self._deltas[key] = delta
        while len(self._deltas) > MAX_CACHED_DELTAS:
            self._deltas.pop(next(iter(self._deltas)))
        return delta

    async def mirror(self, manifest: Manifest, data: memoryview) -> None:
        """Commit a version pulled (and verified) from an upstream, as it is: a relay's commit. A
        version of sharded replicas is whole here: the relay serves all of it."""
        manifest = dataclasses.replace(manifest, parts=())
        await self.store.commit(Version(manifest, manifest.safetensors_header(), data))

    def count_pulled(self, model: str, transport: str, nbytes: int) -> None:
        self.metrics.pull_bytes.labels(model, transport).inc(nbytes)

    def watch(self, model: str, after: int | None) -> AsyncIterator[Manifest]:
        check_model_name(model)
        return self.store.watch(model, after)

    def ack(self, model: str, version: int, client_id: str) -> int:
        return self.store.ack(model, version, client_id)

    async def topology(self) -> list[Replica]:
        """The replicas as the registry knows them; while it is unreachable, as it last knew them
        (clients keep pulling from the owners; pushes fail at their commit, with UNAVAILABLE)."""
        try:
            self._topology = await self.store.registry.replicas()
        except Unavailable:
            if self._topology is None:
                raise
        return self._topology

    def clients(self, model: str) -> list[ClientAck]:
        return self.store.clients(model)
