"""uvicorn's HTTP/1.1 protocol with the limits a server facing untrusted clients needs.

uvicorn holds a connection that sends nothing for as long as the client likes, and reads a request
head or body of any size at any pace: a thousand idle sockets took the descriptors of the whole
process, four 64 MiB heads 300 MiB of memory, and fifty bodies trickling a byte a second every
connection, before any token was checked. Here each connection must send a whole request head
(request line and headers, at most MAX_HEAD_BYTES) within a time of its opening or of its previous
response, and its body within that time of its head (plus a second per BODY_BYTES_PER_S of it, and
the time the app stops reading it); at most a number of connections are held at once. At that
number, a new connection takes the place of the one that has waited longest without sending a byte
of its next request (so idle sockets cannot keep others out); if every one is busy, it is let in as
a probe, outside the bound: it may ask for /healthz or /readyz (a liveness probe must not fail
because clients hold every connection), anything else is answered 503.

A refused request (a head too large, a probe asking for more) is answered, then what the client still
sends is read and dropped for a moment before the connection closes: closed at once, the kernel would
reset it, and the client would see the reset rather than the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from prometheus_client import Gauge

from weightsvc.errors import ResourceExhausted, TooManyRequests
from weightsvc.transport._internals import HttpToolsProtocol

MAX_HEAD_BYTES = 64 << 10
BODY_BYTES_PER_S = 1 << 20  # the slowest pace a request body may come at, past the head timeout
HEALTH_PATHS = (b"/healthz", b"/readyz")
PROBE_SLOTS = 64  # probes beyond the bound at once; one more takes the place of the oldest
LINGER_S = 2.0  # how long a refused connection reads and drops what its client still sends
TLS_CLOSE_S = 1.0  # how long a stopping server waits for an idle TLS peer's close_notify


def _answer(status: str, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


_TOO_LARGE = _answer("431 Request Header Fields Too Large", "RESOURCE_EXHAUSTED",
                     f"the request head is larger than {MAX_HEAD_BYTES} bytes")


class _Refused(Exception):
    """Raised from a parser callback: the request was answered already, parse nothing more."""


class LimitedHttpProtocol(HttpToolsProtocol):
    max_connections = 1000
    head_timeout_s = 10.0
    probes: ClassVar[dict[LimitedHttpProtocol, None]] = {}  # each server's class has its own (`limited_http`)

    @staticmethod
    def dropped(reason: str) -> None:
        """Called with the reason (`metrics.DROP_REASONS`) of each connection the server closes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for (the rest of) a request head
        self._head_bytes = 0  # received while in the head
        self._head_size = 0  # of the head being parsed: its URL and headers
        self._timer: asyncio.TimerHandle | None = None  # the head's or the body's deadline
        self._idle_since: float | None = None  # when it last waited for a request and has sent nothing since
        self._body_since = 0.0
        self._body_bytes = 0
        self._message_done = True  # the request's body has all come (or there is none)
        self._refused = False
        self._probe = False
        self._made = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            idle = [c for c in self.connections if isinstance(c, LimitedHttpProtocol) and c._idle_since is not None]
            if idle:
                oldest = min(idle, key=lambda c: c._idle_since or 0.0)
                self.connections.discard(oldest)  # counted out now: its connection_lost comes later
                oldest._idle_since = None
                oldest.transport.abort()
                self.dropped("over_limit")
            else:
                self._probe = True
        super().connection_made(transport)
        self._made = True
        if self._probe:
            self.connections.discard(self)  # not counted: it may only ask for a health path
            if len(self.probes) >= PROBE_SLOTS:
                oldest = next(iter(self.probes))
                del self.probes[oldest]
                oldest.transport.abort()
                self.dropped("over_limit")
            self.probes[self] = None
        self._await_head()

    def shutdown(self) -> None:
        """The server stops: an idle connection is closed now. Over TLS, asyncio's close sends
        close_notify and waits up to 30 s for the peer's, which an idle client in a pool never reads,
        so the server's stop waited 30 s per such client: it is given TLS_CLOSE_S, then cut."""
        super().shutdown()
        if self.transport.is_closing() and self.transport.get_extra_info("sslcontext") is not None:
            asyncio.get_running_loop().call_later(TLS_CLOSE_S, self.transport.abort)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self.probes.pop(self, None)
        if self._made:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered: what the client still sends is dropped until it stops
        self._idle_since = None
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self._refused:
            self._refuse(_TOO_LARGE, "head_too_large")  # a head that has not even ended yet

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # (a refusal stops the parser with an error: it was answered already)
            super().send_400_response(msg)

    # ---- parser callbacks

    def on_message_begin(self) -> None:
        self._head_size = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4  # "name: value\r\n"
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_timer()
        # "METHOD URL HTTP/1.1\r\n", the headers, "\r\n"
        if self._head_size + len(self.parser.get_method()) + 14 > MAX_HEAD_BYTES:
            self._refuse(_TOO_LARGE, "head_too_large")
            raise _Refused
        if self._probe and self.url.partition(b"?")[0] not in HEALTH_PATHS:
            message = (f"the server holds {self.max_connections} connections (--max-connections), all busy; "
                       "retry later")
            self._refuse(_answer("503 Service Unavailable", "UNAVAILABLE", message), "over_limit")
            raise _Refused
        super().on_headers_complete()
        if self._probe and self.cycle is not None:
            self.cycle.keep_alive = False  # a probe's connection serves one answer
        if any(name in (b"content-length", b"transfer-encoding") and value.strip() not in (b"", b"0")
               for name, value in self.headers):
            self._message_done = False
            self._body_since, self._body_bytes = self.loop.time(), 0
            self._timer = self.loop.call_later(self.head_timeout_s, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._message_done = True
        self._stop_timer()
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
            self._await_head()  # answered before its body ended: the next request may come now

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._message_done and not self.transport.is_closing():
            self._await_head()

    # ---- deadlines and refusals

    def _await_head(self) -> None:
        self._in_head, self._head_bytes = True, 0
        self._idle_since = self.loop.time()
        self._stop_timer()
        self._timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._in_head and not self.transport.is_closing():
            self.dropped("head_timeout")
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._timer = None
        if self._message_done or self.transport.is_closing():
            return
        if self.flow.read_paused:
            # The app is not reading (a push rank waiting for the others): its wait is not the client's
            # slowness. The pace counts again from when reading resumes.
            self._body_since, self._body_bytes = self.loop.time(), 0
            self._timer = self.loop.call_later(self.head_timeout_s, self._body_timed_out)
            return
        left = self._body_since + self.head_timeout_s + self._body_bytes / BODY_BYTES_PER_S - self.loop.time()
        if left > 0:  # it keeps the pace: its deadline moves on with what it sent
            self._timer = self.loop.call_later(left, self._body_timed_out)
            return
        self.dropped("body_timeout")
        self.transport.close()  # the app reading it sees the client gone

    def _refuse(self, answer: bytes, reason: str) -> None:
        self._refused = True
        self._stop_timer()
        self.dropped(reason)
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer, then end of stream; reading goes on, and drops
            self._timer = self.loop.call_later(LINGER_S, self.transport.abort)
        else:
            self.transport.close()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def limited_http(max_connections: int, head_timeout_s: float,
                 dropped: Callable[[str], None] = lambda reason: None) -> type[LimitedHttpProtocol]:
    """The protocol class for uvicorn's `http` setting, with these limits."""
    return type("LimitedHttp", (LimitedHttpProtocol,),
                {"max_connections": max_connections, "head_timeout_s": head_timeout_s, "probes": {},
                 "dropped": staticmethod(dropped)})


class BodyBudget:
    """Bytes of request bodies being read at once, bounded: a body is held whole until it is parsed,
    so many large ones at once would take the memory of the process (`--max-body-bytes`)."""

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.used = 0
        self._gauge = gauge

    @contextlib.contextmanager
    def hold(self, what: str) -> Iterator[HeldBody]:
        held = HeldBody(self, what)
        try:
            yield held
        finally:
            self.used -= held.bytes
            self._gauge.set(self.used)


class HeldBody:
    """The part of the budget one body holds, growing as the body comes."""

    def __init__(self, budget: BodyBudget, what: str) -> None:
        self.budget, self.what, self.bytes = budget, what, 0

    def grow_to(self, size: int) -> None:
        b = self.budget
        if size <= self.bytes:
            return
        if size > b.limit:
            raise ResourceExhausted(f"{self.what}: a body of {size} bytes, more than the {b.limit} bytes of "
                                    "--max-body-bytes", reason="too_large")
        if b.used - self.bytes + size > b.limit:
            raise TooManyRequests(f"{self.what}: request bodies of {b.used} bytes are being read, and {size} more "
                                  f"would pass --max-body-bytes {b.limit}; retry later", reason="too_many")
        b.used += size - self.bytes
        self.bytes = size
        b._gauge.set(b.used)
