"""Small HTTP/1 exchanges in threads, each bounded as a whole: a socket's timeout bounds each read, and
a peer that sends a byte just within it holds the exchange for as long as it likes. `cut_after` shuts
a socket once its time is up; `SmallHttpServer` (the follower's server) gives
each connection that long for its one request and answer, and serves at most so many at once."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Cut", "SmallHttpServer", "cut_after"]


class Cut:
    """Whether `cut_after` shut its socket (the exchange ran out of time)."""

    def __init__(self) -> None:
        self.fired = False


@contextlib.contextmanager
def cut_after(sock: socket.socket, seconds: float) -> Iterator[Cut]:
    """Shut `sock` (both ways) if the block has not ended within `seconds`: a read blocked on it
    returns at once (end of stream), a write fails. `.fired` says whether it was cut."""
    cut = Cut()

    def shut() -> None:
        cut.fired = True
        with contextlib.suppress(OSError):  # (closed meanwhile)
            sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(seconds, shut)
    timer.daemon = True
    timer.start()
    try:
        yield cut
    finally:
        timer.cancel()


class SmallHttpServer(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` for a few short requests: one request per connection (HTTP/1.0), each
    connection cut after `deadline_s`, at most `max_connections` served at once (more are closed
    as they come), so slow, silent or many peers cannot grow its threads."""

    daemon_threads = True
    # socketserver's backlog is 5: a burst of connections (an engine's workers reporting at once, or
    # many peers) past it waits out TCP's SYN retries, seconds each, before it is even answered.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 max_connections: int = 32, deadline_s: float = 5.0) -> None:
        super().__init__(address, handler)
        self.deadline_s = deadline_s
        self.refused = 0  # connections closed for want of a slot
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            with cut_after(request, self.deadline_s):
                super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a peer cut off or gone mid-request: nothing to report, its connection is closed
