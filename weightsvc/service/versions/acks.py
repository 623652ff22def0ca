"""Serving staleness: which version each inference client acked, how many versions behind the latest
that is, and how long a version took from commit to its first ack.

Loop-owned: every method runs on the service's event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from dataclasses import dataclass

from weightsvc.errors import InvalidArgument, NotFound
from weightsvc.metrics import Metrics
from weightsvc.protocol.clients import ClientStatus
from weightsvc.service.replicas.registry import Registry
from weightsvc.service.versions.index import VersionIndex

log = logging.getLogger("weightsvc.store")

MAX_CLIENTS_PER_MODEL = 10_000
MAX_HISTORY = 100_000  # committed (version, time) pairs remembered per model, for staleness
CLIENT_TIMEOUT_S = 300.0  # a client that has not acked for this long no longer counts as connected


@dataclass
class ClientAck:
    client_id: str
    version: int
    acked_unix: float


class Acks:
    """The clients' acks per model, against the history of committed versions (which outlives retention)."""

    def __init__(self, index: VersionIndex, registry: Registry, metrics: Metrics) -> None:
        self._index = index
        self._registry = registry
        self._metrics = metrics
        self._clients: dict[str, dict[str, ClientAck]] = {}
        self._acking: set[asyncio.Future[None]] = set()
        self._history: dict[str, list[tuple[int, float]]] = {}  # committed versions, in order
        # A client silent for longer than this is forgotten by the staleness metrics; until then it
        # counts (with the version it acked last), so one that is stuck keeps its alert firing.
        self.forget_s = 3600.0
        metrics.watch_clients(self.tracked)

    def committed(self, model: str, version: int, committed_unix: float) -> None:
        """Remember a version as committed (by this server, or restored) at `committed_unix`."""
        history = self._history.setdefault(model, [])
        history.append((version, committed_unix))
        del history[:-MAX_HISTORY]

    def versions_behind(self, model: str, version: int) -> int:
        """How many committed versions of `model` are newer than `version`."""
        history = self._history.get(model, [])
        return len(history) - bisect.bisect_right(history, (version, math.inf))

    def ack(self, model: str, version: int, client_id: str) -> int:
        """Record that `client_id` serves `version` of `model`; returns the latest committed version."""
        latest = self._index.latest(model)
        if latest is None:
            raise NotFound(f"unknown model {model!r}: nothing has been committed for it")
        if version < 0 or version > latest:
            raise InvalidArgument(f"model {model!r}: cannot ack version {version}, the latest committed is {latest}")
        if not client_id or len(client_id) > 256:
            raise InvalidArgument("ack needs a client_id of 1-256 characters")
        clients = self._clients.setdefault(model, {})
        previous = clients.pop(client_id, None)
        now = time.time()
        clients[client_id] = ClientAck(client_id, version, now)
        while len(clients) > MAX_CLIENTS_PER_MODEL:  # bounded memory: forget the longest-silent
            clients.pop(next(iter(clients)))
        if previous is None or previous.version != version:  # the first ack of this version: synced
            history = self._history.get(model, [])
            i = bisect.bisect_left(history, (version, -math.inf))
            if i < len(history) and history[i][0] == version:
                self._metrics.version_sync_seconds.labels(model).observe(max(0.0, now - history[i][1]))
        # Shared with the other replicas when the registry is Redis; an ack is not worth failing
        # for, so an unreachable registry only costs the fleet-wide view of this one.
        task = asyncio.ensure_future(self._registry.ack(model, client_id, version, now))
        self._acking.add(task)
        task.add_done_callback(self._acked)
        return latest

    async def flush(self) -> None:
        """Wait for the acks on their way to the registry."""
        await asyncio.gather(*self._acking, return_exceptions=True)

    def _acked(self, task: asyncio.Future[None]) -> None:
        self._acking.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("ack not recorded in the registry: %s", task.exception())

    def clients(self, model: str) -> list[ClientStatus]:
        """The clients that acked a version of `model`: what each holds, how far behind, whether it is
        still around."""
        horizon = time.time() - CLIENT_TIMEOUT_S
        return [
            ClientStatus(a.client_id, a.version, self.versions_behind(model, a.version), a.acked_unix,
                         a.acked_unix >= horizon)
            for a in self._clients.get(model, {}).values()
        ]

    def tracked(self) -> dict[str, list[ClientStatus]]:
        """The clients that acked within `forget_s`, per model (read at every scrape)."""
        horizon = time.time() - self.forget_s
        return {model: [c for c in self.clients(model) if c.last_seen_unix >= horizon] for model in self._clients}
