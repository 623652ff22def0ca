"""Every use of what uvicorn, asyncio, grpcio and Linux do not offer as a public API, in one place.

uvicorn has no ASGI extension for sendfile nor for writing a body from other threads, no hook for a
connection's limits, and no way to serve without taking the process's signals; asyncio no way to
keep its transport from writing meanwhile; gRPC no way to close one connection; grpcio-health
exports its asyncio servicer from a private module. Each use is a function here, and `missing()`
names what the installed libraries no longer have (a unit test calls it), so an upgrade that breaks
one fails there, by name, not in a pull under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import socket
from asyncio import selector_events
from typing import Any

import uvicorn
from grpc_health.v1._async import HealthServicer
from uvicorn.protocols.http import flow_control, httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HealthServicer", "HttpToolsProtocol"]

# ---- uvicorn's request-response cycle (httptools_impl.RequestResponseCycle) ---------------------


def response_cycle(send: Any) -> Any:
    """The uvicorn cycle whose `send` this is, when it counts its body (plain uvicorn HTTP/1.1); else None."""
    cycle = getattr(send, "__self__", None)
    return cycle if isinstance(getattr(cycle, "expected_content_length", None), int) else None


def connection_of(send: Any) -> Any:
    """The asyncio transport of the connection `send` answers on, or None."""
    return getattr(getattr(send, "__self__", None), "transport", None)


def sent_around(cycle: Any, nbytes: int) -> None:
    """`nbytes` of the body went to the socket around uvicorn's send: its Content-Length check counts them."""
    cycle.expected_content_length -= nbytes


def disconnected(cycle: Any) -> None:
    """The client is gone (as the transport's `connection_lost` will say, soon): uvicorn sends no more."""
    cycle.disconnected = True


# ---- uvicorn's server, driven phase by phase ----------------------------------------------------


async def start_uvicorn(config: uvicorn.Config, sock: socket.socket) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serve `config`'s app on the bound `sock`: the server and the task of its tick loop (Date header,
    shutdown flag). `Server.serve` would also install signal handlers; the CLI owns those."""
    server = uvicorn.Server(config)
    config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    return server, asyncio.create_task(server.main_loop())


async def stop_uvicorn(server: uvicorn.Server, ticking: asyncio.Task[None]) -> None:
    server.should_exit = True
    await ticking
    await server.shutdown()


# ---- asyncio's selector transport ---------------------------------------------------------------


def can_hold_writes(transport: Any) -> bool:
    """Whether `hold_writes` works on this transport (asyncio's selector transports)."""
    return hasattr(transport, "_make_empty_waiter")


def hold_writes(transport: Any) -> asyncio.Future[None]:
    """Done once the transport has sent what it holds; its own writes fail until `release_writes`."""
    return transport._make_empty_waiter()  # type: ignore[no-any-return]


def release_writes(transport: Any) -> None:
    transport._reset_empty_waiter()


# ---- the process's sockets (gRPC offers no way to close one connection) ------------------------


def connected_sockets(port: int) -> dict[tuple[str, int], int]:
    """The connected sockets of this process whose local port is `port`: peer address -> descriptor."""
    out: dict[tuple[str, int], int] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            peer = _peer_of(int(name), port)
            if peer is not None:
                out[peer] = int(name)
    return out


def _peer_of(fd: int, port: int) -> tuple[str, int] | None:
    sock = socket.socket(fileno=fd)
    try:
        local = sock.getsockname()
        if not (isinstance(local, tuple) and local[1] == port):
            return None
        peer = sock.getpeername()
        return peer[0], peer[1]
    except OSError:
        return None  # the listening socket, or one going away
    finally:
        sock.detach()  # the descriptor is gRPC's: never closed here


def shut_down(fd: int, port: int, peer: tuple[str, int]) -> bool:
    """Shut down the socket `fd` if it still is the connection from `peer` (descriptors are reused)."""
    sock = socket.socket(fileno=fd)
    try:
        local, remote = sock.getsockname(), sock.getpeername()
        if not (isinstance(local, tuple) and local[1] == port and (remote[0], remote[1]) == peer):
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


# ---- what the installed libraries must still have ------------------------------------------------

_SELECTOR_TRANSPORT: type = getattr(selector_events, "_SelectorSocketTransport")  # noqa: B009 (typeshed lacks it)
# What `limits.LimitedHttpProtocol` reads of the protocol it extends, besides the parser callbacks it overrides.
_PROTOCOL_STATE = ("connections", "cycle", "flow", "parser", "headers", "transport", "loop")
_PROTOCOL_METHODS = ("connection_made", "connection_lost", "data_received", "send_400_response", "on_message_begin",
                     "on_url", "on_header", "on_headers_complete", "on_body", "on_message_complete",
                     "on_response_complete")


def _sets(cls: type, method: str, attribute: str) -> bool:
    """Whether `cls.method` (its source) sets `self.attribute`."""
    return re.search(rf"self\.{attribute}\s*(:[^=\n]*)?=", inspect.getsource(getattr(cls, method))) is not None


def missing() -> list[str]:
    """What the code above relies on and the installed libraries lack, by name (empty: nothing)."""
    cycle = httptools_impl.RequestResponseCycle
    checks = {
        **{f"uvicorn Server.{m}()": inspect.iscoroutinefunction(getattr(uvicorn.Server, m, None))
           for m in ("startup", "main_loop", "shutdown")},
        "uvicorn Server.should_exit": _sets(uvicorn.Server, "__init__", "should_exit"),
        "uvicorn Config.lifespan_class": _sets(uvicorn.Config, "load", "lifespan_class"),
        "uvicorn RequestResponseCycle.expected_content_length": _sets(cycle, "__init__", "expected_content_length"),
        "uvicorn RequestResponseCycle.disconnected": _sets(cycle, "__init__", "disconnected"),
        "uvicorn RequestResponseCycle.transport": _sets(cycle, "__init__", "transport"),
        "uvicorn RequestResponseCycle.send": inspect.iscoroutinefunction(getattr(cycle, "send", None)),
        "uvicorn FlowControl.read_paused": _sets(flow_control.FlowControl, "__init__", "read_paused"),
        "uvicorn HttpToolsProtocol.url": _sets(HttpToolsProtocol, "on_message_begin", "url"),
        **{f"uvicorn HttpToolsProtocol.{a}": _sets(HttpToolsProtocol, "__init__", a)
           or _sets(HttpToolsProtocol, "connection_made", a) for a in _PROTOCOL_STATE},
        **{f"uvicorn HttpToolsProtocol.{m}()": callable(getattr(HttpToolsProtocol, m, None))
           for m in _PROTOCOL_METHODS},
        "asyncio _SelectorSocketTransport._make_empty_waiter()": hasattr(_SELECTOR_TRANSPORT, "_make_empty_waiter"),
        "asyncio _SelectorSocketTransport._reset_empty_waiter()": hasattr(_SELECTOR_TRANSPORT, "_reset_empty_waiter"),
        "Linux /proc/self/fd": os.path.isdir("/proc/self/fd"),
    }
    return [name for name, held in checks.items() if not held]
