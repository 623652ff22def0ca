"""uvicorn's HTTP/1.1 protocol with the limits a server facing untrusted clients needs.

uvicorn holds a connection that sends nothing for as long as the client likes, and reads a request
head of any size: a thousand idle sockets took the descriptors of the whole process, and four
64 MiB heads 300 MiB of memory, before any token was checked. Here each connection must send a
whole request head (request line and headers, at most MAX_HEAD_BYTES) within a time of its opening
or of its previous response, and at most a number of connections are held at once. At that number,
a new connection takes the place of the one that has waited longest without sending a byte of its
next request (so idle sockets cannot keep others out); if every one is sending, it is closed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 << 10
_MESSAGE = f"the request head is larger than {MAX_HEAD_BYTES} bytes"
_BODY = json.dumps({"error": {"code": "RESOURCE_EXHAUSTED", "message": _MESSAGE}}).encode()
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
              b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))

class LimitedHttpProtocol(HttpToolsProtocol):
    max_connections = 1000
    head_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for (the rest of) a request head
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # when it last waited for a request and has sent nothing since
        self._made = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            idle = [c for c in self.connections if isinstance(c, LimitedHttpProtocol) and c._idle_since is not None]
            if not idle:
                transport.abort()  # not added to the connections: nothing else to undo
                return
            oldest = min(idle, key=lambda c: c._idle_since or 0.0)
            self.connections.discard(oldest)  # counted out now: its connection_lost comes later
            oldest._idle_since = None
            oldest.transport.abort()
        super().connection_made(transport)
        self._made = True
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self._made:  # (a connection refused at the limit was never set up)
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self.transport.write(_TOO_LARGE)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def _await_head(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._idle_since = self.loop.time()
        self._stop_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self.transport.close()

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def limited_http(max_connections: int, head_timeout_s: float) -> type[LimitedHttpProtocol]:
    """The protocol class for uvicorn's `http` setting, with these limits."""
    return type("LimitedHttp", (LimitedHttpProtocol,),
                {"max_connections": max_connections, "head_timeout_s": head_timeout_s})
