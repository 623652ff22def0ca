"""Serving staleness: which version each inference client acked, how many versions behind the latest
that is, and how long a version took from commit to its first ack.

The table is bounded (`ACKS_KEPT` clients a model) and forgets a client silent for `forget_s`; when it
is full, a new client takes the place of the longest-silent one that is not behind, never of one still
tracked as stale (its alert must not clear because others acked), and is refused when every place is
held by a stale one. A client id belongs to the caller that first acked under it (its token, or its
host with auth off): another caller acking under it is refused.

Loop-owned: every method runs on the service's event loop.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass

from weightsvc.errors import InvalidArgument, NotFound, PermissionDenied, TooManyRequests, Unavailable
from weightsvc.metrics import Metrics
from weightsvc.protocol.clients import ClientStatus
from weightsvc.service.replicas.registry import ACKS_KEPT, Registry
from weightsvc.service.versions.index import VersionIndex

log = logging.getLogger("weightsvc.store")

MAX_HISTORY = 100_000  # committed (version, time) pairs remembered per model, for staleness
CLIENT_TIMEOUT_S = 300.0  # a client that has not acked for this long no longer counts as connected


@dataclass
class ClientAck:
    client_id: str
    version: int
    acked_unix: float
    caller: str  # who acked under this id first (see `weightsvc.transport.auth.caller`): only it may again


class Acks:
    """The clients' acks per model, against the history of committed versions (which outlives retention)."""

    def __init__(self, index: VersionIndex, registry: Registry, metrics: Metrics, forget_s: float = 3600.0) -> None:
        self._index = index
        self._registry = registry
        self._metrics = metrics
        self._clients: dict[str, dict[str, ClientAck]] = {}
        self._history: dict[str, list[tuple[int, float]]] = {}  # committed versions, in order
        # A client silent for longer than this is forgotten by the staleness metrics; until then it
        # counts (with the version it acked last), so one that is stuck keeps its alert firing.
        self.forget_s = forget_s
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

    async def ack(self, model: str, version: int, client_id: str, caller: str) -> int:
        """Record that `client_id`, acking as `caller`, serves `version` of `model`; returns the latest
        committed version."""
        latest = self._index.latest(model)
        if latest is None:
            raise NotFound(f"unknown model {model!r}: nothing has been committed for it")
        if version < 0 or version > latest:
            raise InvalidArgument(f"model {model!r}: cannot ack version {version}, the latest committed is {latest}")
        if not client_id or len(client_id) > 256:
            raise InvalidArgument("ack needs a client_id of 1-256 characters")
        now = time.time()
        clients = self._clients.setdefault(model, {})
        self._expire(clients, now)
        previous = clients.get(client_id)
        if previous is not None and previous.caller != caller:
            raise _taken(model, client_id)
        if previous is None and len(clients) >= ACKS_KEPT:
            self._room(model, clients, latest)  # refused before the registry hears of it
        # Shared with the other replicas when the registry is Redis, which binds the id fleet-wide; an
        # unreachable registry only costs the fleet-wide view of this ack, not the ack.
        try:
            accepted = await self._registry.ack(model, client_id, version, now, caller, self.forget_s)
        except Unavailable as e:
            log.warning("ack not recorded in the registry: %s", e)
            accepted = True
        if not accepted:
            raise _taken(model, client_id)
        previous = clients.pop(client_id, None)  # (re-inserted: the table stays in order of last ack)
        if previous is not None and previous.caller != caller:  # another caller won it while we asked
            clients[client_id] = previous
            raise _taken(model, client_id)
        if previous is None and len(clients) >= ACKS_KEPT:
            del clients[self._room(model, clients, latest)]
        clients[client_id] = ClientAck(client_id, version, now, caller)
        if previous is None or previous.version != version:  # the first ack of this version: synced
            history = self._history.get(model, [])
            i = bisect.bisect_left(history, (version, -math.inf))
            if i < len(history) and history[i][0] == version:
                self._metrics.version_sync_seconds.labels(model).observe(max(0.0, now - history[i][1]))
        return latest

    def _expire(self, clients: dict[str, ClientAck], now: float) -> None:
        """Forget the clients silent for `forget_s` (the table is in order of last ack)."""
        horizon = now - self.forget_s
        while clients:
            oldest = next(iter(clients.values()))
            if oldest.acked_unix >= horizon:
                break
            del clients[oldest.client_id]

    def _room(self, model: str, clients: dict[str, ClientAck], latest: int) -> str:
        """The client a new one may replace: the longest-silent one that holds the latest version;
        refused when every client is behind, as each of them is an alert a flood of new ids must not
        clear."""
        for c in clients.values():
            if c.version >= latest:
                return c.client_id
        raise TooManyRequests(
            f"model {model!r}: {len(clients)} clients are tracked, every one behind version {latest}; a new client "
            f"id is taken once one of them catches up or stays silent for {self.forget_s:.0f} s (--client-forget-s)",
            reason="too_many",
        )

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


def _taken(model: str, client_id: str) -> PermissionDenied:
    return PermissionDenied(
        f"model {model!r}: client id {client_id!r} acks for another caller (another token, or another host "
        "with auth off); ack under a client id of your own", reason="permission_denied")
