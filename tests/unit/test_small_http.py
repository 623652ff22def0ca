"""The follower's small HTTP server takes a burst of connections at once."""

from __future__ import annotations

import contextlib
import socket
from http.server import BaseHTTPRequestHandler

from weightsvc._small_http import SmallHttpServer


def test_a_burst_of_connections_is_queued_not_left_to_tcps_retries() -> None:
    """Every connection of a burst completes its handshake while the server has not accepted any yet
    (socketserver's default backlog of 5 drops the rest, which then wait out SYN retries: 49 s for
    300 peers before the backlog was raised)."""
    server = SmallHttpServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # (never serving: nothing accepted)
    with server, contextlib.ExitStack() as stack:
        for _ in range(100):
            # A dropped SYN is sent again after 1 s: within 0.5 s the handshake is done or it never was.
            sock = stack.enter_context(socket.create_connection(server.server_address[:2], timeout=0.5))
            assert sock.getpeername() == server.server_address[:2]
