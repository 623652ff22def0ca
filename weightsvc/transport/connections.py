"""The gRPC port's connections, bounded by this process rather than only by gRPC's accept.

gRPC closes a new connection once `grpc.max_allowed_incoming_connections` are held, whoever holds
them: tokenless clients that each made one refused call, or watchers whose stream ended, kept a
learner with a valid token out for as long as they liked. gRPC offers no way to close one connection,
so this module finds the connection's socket among the process's descriptors (by its peer's address,
as a call's `context.peer()` gives it; `_internals`) and shuts it down; gRPC then drops the
connection, and a client's channel reconnects at its next call.

- A connection that fails authentication is closed once the refusal is sent (`refused` is called
  only then: a connection shut before its answer went out leaves the client without one), unless a
  call of it is still running.
- gRPC admits `limit + headroom(limit)` connections; every SWEEP_S, or at once when a call is
  refused, connections beyond `limit` are closed, those without a call longest first, so a new
  connection always finds room. Connections with calls running are never closed: pushes and pulls
  have their own bounds, watches theirs (`Settings.watch_limit`, at most half the connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any

from weightsvc.transport import _internals

log = logging.getLogger("weightsvc.grpc")

Peer = tuple[str, int]
SWEEP_S = 1.0
ANSWER_S = 0.25  # refused connections are closed in batches this far apart, not one scan each


def headroom(limit: int) -> int:
    """Connections gRPC admits beyond `limit`, to be trimmed by the sweep."""
    return max(16, limit // 4)


def parse_peer(peer: str) -> Peer | None:
    """("host", port) of gRPC's "ipv4:127.0.0.1:5000" / "ipv6:[::1]:5000"; None for other kinds."""
    kind, _, address = peer.partition(":")
    host, _, port = urllib.parse.unquote(address).rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    return _host(host.strip("[]")), int(port)


def _host(host: str) -> str:
    return host.removeprefix("::ffff:")  # an IPv4 client of a dual-stack socket


def _sockets(port: int) -> dict[Peer, tuple[int, Peer]]:
    """The connected sockets of this process whose local port is `port`: peer (as `parse_peer` gives it)
    -> (descriptor, peer address as the socket gives it)."""
    return {(_host(host), p): (fd, (host, p)) for (host, p), fd in _internals.connected_sockets(port).items()}


class GrpcConnections:
    def __init__(self, limit: int, dropped: Callable[[str], None]) -> None:
        self.limit = limit
        self.port = 0  # set once the server is bound
        self.dropped = dropped
        self._calls: dict[Peer, int] = {}  # running calls per connection
        self._last: dict[Peer, float] = {}  # when a call of it last started or ended
        self._seen: dict[Peer, float] = {}  # when a sweep first found it
        self._refused: dict[Peer, float] = {}  # when a call of it was refused
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, port: int) -> None:
        self.port = port
        self._task = asyncio.create_task(self._sweep(), name="grpc-connections")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def refused(self, peer: str) -> None:
        """A call of this connection failed authentication, and its answer is sent: close it."""
        p = parse_peer(peer)
        if p is not None:
            loop = asyncio.get_running_loop()
            self._refused.setdefault(p, loop.time())
            loop.call_later(ANSWER_S, self._wake.set)

    def tracked(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, a gRPC handler, counting its call as running on its connection."""
        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                with self._call(context):
                    async for item in fn(request, context):
                        yield item

            return stream

        @functools.wraps(fn)
        async def unary(request: Any, context: Any) -> Any:
            with self._call(context):
                return await fn(request, context)

        return unary

    @contextlib.contextmanager
    def _call(self, context: Any) -> Any:
        peer = parse_peer(context.peer())
        if peer is None:
            yield
            return
        now = asyncio.get_running_loop().time()
        self._calls[peer] = self._calls.get(peer, 0) + 1
        self._last[peer] = now
        try:
            yield
        finally:
            left = self._calls[peer] - 1
            if left:
                self._calls[peer] = left
            else:
                del self._calls[peer]
            self._last[peer] = asyncio.get_running_loop().time()

    async def _sweep(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SWEEP_S):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.sweep()
            except Exception:  # keep sweeping: a failed sweep only leaves connections open
                log.exception("sweeping the gRPC connections failed")
            await asyncio.sleep(ANSWER_S)  # a flood of refusals is swept in batches, not one scan each

    async def sweep(self) -> None:
        """Close the refused connections, and those without a call beyond the limit."""
        held = await asyncio.to_thread(_sockets, self.port)
        now = asyncio.get_running_loop().time()
        for p in list(self._seen):
            if p not in held:
                del self._seen[p]
                self._last.pop(p, None)
        for p in held:
            self._seen.setdefault(p, now)
        answered = [p for p, at in self._refused.items() if at <= now - ANSWER_S]
        close = {p: "unauthenticated" for p in answered if p in held and not self._calls.get(p)}
        for p in answered:
            del self._refused[p]
        over = len(held) - len(close) - self.limit
        if over > 0:
            # Those that never made a call (a refused one does not count) first, then those idle
            # longest: a connection just made has not had the time to call.
            idle = sorted((p for p in held if p not in close and not self._calls.get(p)),
                          key=lambda p: (p in self._last, max(self._last.get(p, 0.0), self._seen[p])))
            close.update((p, "over_limit") for p in idle[:over])
        if close:
            shut = await asyncio.to_thread(
                lambda: [(p, r) for p, r in close.items() if _internals.shut_down(held[p][0], self.port, held[p][1])])
            for _, reason in shut:
                self.dropped(reason)
