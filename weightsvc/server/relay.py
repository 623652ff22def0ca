"""Relays: a server that mirrors every committed version of an upstream weightsvc and serves it.

`weightsvc serve --relay-from HOST:PORT` builds a fan-out tree: learners push to the upstream; each
relay follows it (a Watch per model, models discovered with ListModels), pulls each new version as a
delta against the one it holds, verifies every checksum, and commits the same bytes and manifest
locally (same version number, commit time and lag metrics). Inference servers pull, watch and ack at
the relay. A relay refuses pushes. If the upstream goes away, the relay keeps serving what it has and
catches up when it comes back.

The relay is a set of asyncio tasks on the server's loop (one discovers models, one follows each
model), so everything it reads of the store or commits happens on the loop; the sync client's
blocking calls run in threads. Whatever fails is logged, counted in `weightsvc_relay_failures_total`
by stage, and retried: nothing stops a relay but `stop`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from weightsvc.client import InferenceClient, VersionInfo, verify_data
from weightsvc.errors import NotFound, WeightsvcError

if TYPE_CHECKING:
    from weightsvc.service.service import Service

log = logging.getLogger("weightsvc.relay")

DISCOVER_EVERY_S = 2.0  # how often the relay asks the upstream for models it does not follow yet
RETRY_AFTER_S = 1.0


class Relay:
    def __init__(self, upstream: str, service: Service) -> None:
        self.upstream = upstream
        self.service = service
        self._clients: list[InferenceClient] = []
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._discover: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._discover = asyncio.create_task(self._discover_models(), name="relay-discover")

    async def stop(self) -> None:
        for client in self._clients:
            client.close()  # breaks the watch streams that threads are blocked in
        tasks = [t for t in (self._discover, *self._followers.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _client(self) -> InferenceClient:
        client = InferenceClient(self.upstream)
        self._clients.append(client)
        return client

    def _failed(self, stage: str, what: str, e: BaseException) -> None:
        self.service.metrics.relay_failures.labels(stage).inc()
        expected = isinstance(e, WeightsvcError | ValueError | OSError)  # the upstream's answers, the network
        log.warning("relay: %s %s of %s failed (retrying): %s: %s", stage, what, self.upstream,
                    type(e).__name__, e, exc_info=None if expected else e)

    async def _discover_models(self) -> None:
        client = self._client()
        while True:
            try:
                for summary in await asyncio.to_thread(client.models):
                    model = summary["model"]
                    if model not in self._followers:
                        self._followers[model] = asyncio.create_task(self._follow(model), name=f"relay-{model}")
            except Exception as e:
                self._failed("discover", "the models", e)
            await asyncio.sleep(DISCOVER_EVERY_S)

    async def _follow(self, model: str) -> None:
        client = self._client()
        while True:
            stage = "follow"
            try:
                # Start from the newest upstream version: older ones are not worth the bytes.
                upstream_latest = (await asyncio.to_thread(client.manifest, model)).version
                local = self.service.index.latest(model)
                after = max(local if local is not None else -1, upstream_latest - 1)
                events = client.watch(model, after=after)
                while (info := await asyncio.to_thread(_next, events)) is not None:
                    stage = "mirror"
                    await self._mirror(client, model, info.version)
                    stage = "follow"
            except NotFound:
                pass  # the model's versions expired upstream; it may come back
            except Exception as e:
                self._failed(stage, f"model {model!r}", e)
            await asyncio.sleep(RETRY_AFTER_S)

    async def _mirror(self, client: InferenceClient, model: str, version: int) -> None:
        local = self.service.index.latest(model)
        if local is not None and version <= local:
            return
        held = client.held(model)
        base = held.version if held is not None else None
        manifest, data = await asyncio.to_thread(client.pull_data, model, version, base=base)
        await asyncio.to_thread(verify_data, manifest, data)  # every checksum, before anything is served
        await self.service.mirror(manifest, data)
        log.info("relayed model=%s version=%d bytes=%d pulled=%d", model, version, len(data), client.last_pull_bytes)


def _next(events: Iterator[VersionInfo]) -> VersionInfo | None:
    return next(events, None)
