"""Where an HTTP response's body goes out: uvicorn's plain-HTTP connections offer the app (`Sendfile`)
ways around uvicorn's send, so that the bytes of a pull leave without passing through the event loop:
writer threads that write a body to the socket (`Writer`), the loop's own sendfile, and an abort that
resets the connection."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.types import Receive, Scope, Send

from weightsvc.service.api import FileRange, Piece
from weightsvc.transport import _internals

SENDFILE = "weightsvc.sendfile"  # the ASGI extensions `Sendfile` adds
OFFLOAD = "weightsvc.offload"
ABORT = "weightsvc.abort"
# The threads that write pulls' bytes to their sockets: each waits on its socket, without the GIL, at
# the pace of its client; a pull beyond them waits for one.
WRITERS = 64
WAKE_S = 0.05  # how often a writer waiting on its socket looks whether its pull was dropped


def _reset(transport: asyncio.Transport) -> None:
    """Drop a connection at once: a reset, not a close that would still send what the kernel holds."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


_writers: ThreadPoolExecutor | None = None


def _write(fd: int, piece: Piece, dropped: threading.Event) -> None:
    """Write `piece` to the non-blocking socket `fd` (in a writer thread): wait for room without the
    GIL, stop within WAKE_S once the pull is `dropped`. ConnectionError when the client is gone."""
    ready = select.poll()
    ready.register(fd, select.POLLOUT)
    at, left = 0, len(piece)
    while left:
        if dropped.is_set():
            raise ConnectionAbortedError("the pull was dropped")
        try:
            if isinstance(piece, FileRange):
                sent = os.sendfile(fd, piece.file.fileno(), piece.offset + at, left)
            else:
                sent = os.write(fd, piece[at:])
        except BlockingIOError:
            ready.poll(WAKE_S * 1000)
            continue
        if sent == 0:
            raise ConnectionResetError("the connection closed")
        at, left = at + sent, left - sent


class Writer:
    """One response's body written to its socket by the writer threads, the loop keeping the control:
    `ready` waits until the transport has sent what it holds (the response start) and stops it from
    reading and writing; each `write` hands a piece to a thread; `done` gives the socket back. A write
    cancelled (the stall timeout) stops its thread before it returns: the version's bytes are not read
    after the pull releases it, and the socket is not written after the transport closes it."""

    def __init__(self, transport: Any, cycle: Any) -> None:
        self.transport, self.cycle = transport, cycle
        self.fd = -1
        self.dropped = threading.Event()
        self.reading = False
        self.held = False

    async def ready(self) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("the client went away")
        self.fd = self.transport.get_extra_info("socket").fileno()
        self.reading = self.transport.is_reading()
        self.transport.pause_reading()  # (what the client sends now waits: nothing answers it meanwhile)
        empty = _internals.hold_writes(self.transport)  # the transport's own writes fail until `done`
        self.held = True
        await empty

    async def write(self, piece: Piece) -> None:
        global _writers
        if _writers is None:
            _writers = ThreadPoolExecutor(WRITERS, thread_name_prefix="weightsvc-pull")
        _internals.sent_around(self.cycle, len(piece))
        writing = asyncio.wrap_future(_writers.submit(_write, self.fd, piece, self.dropped))
        try:
            await asyncio.shield(writing)
        except asyncio.CancelledError:
            self.dropped.set()
            with contextlib.suppress(Exception):
                await writing
            raise
        except ConnectionError:
            self.done()
            _reset(self.transport)
            _internals.disconnected(self.cycle)
            raise

    def done(self) -> None:
        if self.held:
            self.held = False
            _internals.release_writes(self.transport)
            if self.reading:
                self.transport.resume_reading()


class Sendfile:
    """ASGI middleware that offers the app `scope["extensions"][OFFLOAD]`: `offload()` is a `Writer`
    that writes a body to the connection from worker threads (a range of a file with the kernel's
    sendfile, so a version in the data dir goes from the page cache to the socket without passing
    through this process), and `[SENDFILE]`: `await sendfile(file_range)`, the loop's own.
    uvicorn has no ASGI extension for it: this reaches the transport of its plain-HTTP connections;
    on TLS (or another server) nothing is offered and the app sends bytes as usual."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cycle = _internals.response_cycle(send)  # uvicorn's request-response cycle, counting the body it sends
        transport = _internals.connection_of(send)
        if scope["type"] == "http" and transport is not None:
            scope = {**scope, "extensions": {**(scope.get("extensions") or {}), ABORT: lambda: _reset(transport)}}
        if scope["type"] == "http" and scope.get("scheme") == "http" and cycle is not None and transport is not None:

            async def sendfile(piece: FileRange) -> None:
                _internals.sent_around(cycle, piece.count)  # (uvicorn's send checks the body against Content-Length)
                if transport.is_closing():
                    return  # the client went away; uvicorn's own send ignores what follows
                with contextlib.suppress(ConnectionError):
                    await asyncio.get_running_loop().sendfile(transport, piece.file, piece.offset, piece.count)

            extensions: dict[str, Any] = {SENDFILE: sendfile}
            if _internals.can_hold_writes(transport):
                extensions[OFFLOAD] = lambda: Writer(transport, cycle)
            scope = {**scope, "extensions": {**(scope.get("extensions") or {}), **extensions}}
        await self.app(scope, receive, send)
