"""Relays: a server that mirrors every committed version of an upstream weightsvc and serves it.

`weightsvc serve --relay-from HOST:PORT` builds a fan-out tree: learners push to the upstream; each
relay follows it (gRPC Watch per model, models discovered with ListModels), pulls each new version
as a delta against the one it holds, verifies every checksum, and commits the same bytes and
manifest locally (same version number, commit time and lag metrics). Inference servers pull, watch
and ack at the relay. A relay refuses pushes. If the upstream goes away, the relay keeps serving
what it has and catches up when it comes back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from weightsvc.client import InferenceClient, tensors_from_data
from weightsvc.errors import NotFound, WeightsvcError

if TYPE_CHECKING:
    from weightsvc.core.service import Service

log = logging.getLogger("weightsvc.relay")

DISCOVER_EVERY_S = 2.0  # how often the relay asks the upstream for models it does not follow yet
RETRY_AFTER_S = 1.0


class Relay:
    """Follows an upstream from threads (the sync clients); commits on the server's loop."""

    def __init__(self, upstream: str, service: Service, loop: asyncio.AbstractEventLoop) -> None:
        self.upstream = upstream
        self.service = service
        self.loop = loop
        self._stop = threading.Event()
        self._followers: dict[str, threading.Thread] = {}
        self._clients: list[InferenceClient] = []
        self._lock = threading.Lock()
        self._discover = threading.Thread(target=self._discover_models, name="relay-discover", daemon=True)

    def start(self) -> None:
        self._discover.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for client in self._clients:
                client.close()  # breaks the followers' watch streams
        for thread in [self._discover, *self._followers.values()]:
            if thread.is_alive():
                thread.join(timeout=10)

    def _client(self) -> InferenceClient:
        client = InferenceClient(self.upstream)
        with self._lock:
            self._clients.append(client)
        return client

    def _discover_models(self) -> None:
        client = self._client()
        while not self._stop.is_set():
            try:
                for summary in client.models():
                    model = summary["model"]
                    if model not in self._followers:
                        thread = threading.Thread(
                            target=self._follow, args=(model,), name=f"relay-{model}", daemon=True
                        )
                        self._followers[model] = thread
                        thread.start()
            except (WeightsvcError, ValueError) as e:
                if not self._stop.is_set():
                    log.warning("relay: cannot list the models of %s: %s", self.upstream, e)
            self._stop.wait(DISCOVER_EVERY_S)

    def _follow(self, model: str) -> None:
        client = self._client()
        while not self._stop.is_set():
            try:
                # Start from the newest upstream version: older ones are not worth the bytes.
                upstream_latest = client.manifest(model).version
                local = self.service.store.latest(model)
                after = max(local if local is not None else -1, upstream_latest - 1)
                for info in client.watch(model, after=after):
                    self._mirror(client, model, info.version)
            except NotFound:
                pass  # the model's versions expired upstream; it may come back
            except (WeightsvcError, ValueError) as e:
                if self._stop.is_set():
                    return
                log.warning("relay: following model %r of %s: %s", model, self.upstream, e)
            self._stop.wait(RETRY_AFTER_S)

    def _mirror(self, client: InferenceClient, model: str, version: int) -> None:
        local = self.service.store.latest(model)
        if local is not None and version <= local:
            return
        held = client.held(model)
        manifest, data = client.pull_data(model, version, base=held.version if held is not None else None)
        tensors_from_data(manifest, data)  # every checksum, before anything is served
        asyncio.run_coroutine_threadsafe(self.service.mirror(manifest, data), self.loop).result()
        log.info("relayed model=%s version=%d bytes=%d pulled=%d", model, version, len(data), client.last_pull_bytes)
