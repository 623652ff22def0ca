"""The transport-agnostic core: what happens on push, pull, list, watch and ack.

The gRPC servicer and the HTTP routes translate their requests into these calls and the domain
errors back; nothing about versions, export or metrics lives in them. A push's lifecycle is in
`core.push`, its staging and export in `core.staging`, committed versions in `core.store`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import overload

from weightsvc import rounding
from weightsvc.core.delta import compatible as delta_compatible
from weightsvc.core.delta import encode as delta_encode
from weightsvc.core.manifest import (
    Manifest,
    check_model_name,
)
from weightsvc.core.pull import ClientStatus, Pull, watching
from weightsvc.core.push import Pushes, PushMessage
from weightsvc.core.registry import MemoryRegistry, RedisRegistry
from weightsvc.core.store import CLIENT_TIMEOUT_S, Version, VersionStore
from weightsvc.core.topology import Replica
from weightsvc.errors import (
    FailedPrecondition,
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
        return [v.manifest for v in self.store.versions(model)]

    def manifest(self, model: str, version: int | None) -> Manifest:
        return self.store.get(model, version).manifest

    def latest(self, model: str) -> int:
        """The model's latest committed version (NOT_FOUND for a model without any)."""
        return self.store.get(model, None).manifest.version

    async def pull(self, model: str, version: int | None, transport: str, *, base: int | None = None) -> Pull:
        """Start a pull of `version` (None: the latest). With `base` (a version the client holds), the
        body is the delta encoding against it when there is one, else the data section as always."""
        pull = Pull(self, self.open_pull(model, version, transport), transport)
        try:
            if base is not None and pull.version.part is None:
                with contextlib.suppress(FailedPrecondition):
                    pull.use_delta(base, await self.delta(pull.version, base))
        except BaseException:
            pull.close()
            raise
        return pull

    async def pull_delta(self, model: str, version: int | None, base: int, transport: str) -> Pull:
        """Start a pull whose body is the delta encoding of `version` against `base`; FAILED_PRECONDITION
        saying why when there is none (the client then pulls the whole version)."""
        pull = Pull(self, self.open_pull(model, version, transport), transport)
        try:
            pull.use_delta(base, await self.delta(pull.version, base))
        except BaseException:
            pull.close()
            raise
        return pull

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

    async def delta(self, version: Version, base: int) -> bytes:
        """The delta encoding of `version` against `base` of the same model. FAILED_PRECONDITION, saying
        why, when there is none: the base is the version itself or not retained, either is sharded over
        replicas, their layouts differ, or the delta would not be smaller than the dense bytes."""
        m = version.manifest

        def none(why: str) -> FailedPrecondition:
            return FailedPrecondition(f"model {m.model!r} version {m.version}: no delta against base {base}: {why}; "
                                      "pull the whole version")  # fmt: skip

        not_smaller = f"it would not be smaller than the {m.data_bytes} dense bytes"
        key = (m.model, m.version, base)
        if key in self._deltas:  # a fleet pulls the same delta many times: encode it once
            cached = self._deltas[key]
            if cached is None:
                raise none(not_smaller)
            return cached
        if base == m.version:
            raise none("that is the version itself")
        if version.part is not None:
            raise none("the version is sharded over replicas")
        try:
            held = self.open_pull(m.model, base, "delta")
        except NotFound as e:
            raise none(e.message) from None
        try:
            if held.part is not None:
                raise none("the base is sharded over replicas")
            if not delta_compatible(held.manifest, m):
                raise none("the base has other tensors, shapes or dtypes")
            encoded = await asyncio.to_thread(delta_encode, m, version.data, held.data)
        finally:
            self.close_pull(held, "delta")
        delta = encoded if len(encoded) < m.data_bytes else None
        self._deltas[key] = delta
        while len(self._deltas) > MAX_CACHED_DELTAS:
            self._deltas.pop(next(iter(self._deltas)))
        if delta is None:
            raise none(not_smaller)
        return delta

    async def mirror(self, manifest: Manifest, data: memoryview) -> None:
        """Commit a version pulled (and verified) from an upstream, as it is: a relay's commit. A
        version of sharded replicas is whole here: the relay serves all of it."""
        manifest = dataclasses.replace(manifest, parts=())
        await self.store.commit(Version(manifest, manifest.safetensors_header(), data))

    def count_pulled(self, model: str, transport: str, nbytes: int) -> None:
        self.metrics.pull_bytes.labels(model, transport).inc(nbytes)

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
        horizon = time.time() - CLIENT_TIMEOUT_S
        return [
            ClientStatus(a.client_id, a.version, self.store.versions_behind(model, a.version), a.acked_unix,
                         a.acked_unix >= horizon)
            for a in self.store.clients(model)
        ]  # fmt: skip
