"""The process that answers a server's probes (`probes`), started by it with: the listening socket's
descriptor, the shared state's, a pipe's read end (its end: the server is gone), the wedged bound in
seconds, the export device. It imports the standard library, `_small_http` and `probes` alone: it
starts in a fraction of a second and holds a few MiB."""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from weightsvc._small_http import SmallHttpServer
from weightsvc.server.probes import STATE


class _ProbeHandler(BaseHTTPRequestHandler):
    server: Any  # the _ProbeServer

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._answer(*self.server.health())
        elif self.path == "/readyz":
            self._answer(*self.server.readiness())
        else:
            self._answer(404, {"error": {"code": "NOT_FOUND", "message": f"no route GET {self.path[:64]}: "
                                                                       "this port answers /healthz and /readyz"}})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # a probe is no news
        pass


class _ProbeServer(SmallHttpServer):
    def __init__(self, sock: socket.socket, state: mmap.mmap, wedged_s: float, device: str) -> None:
        super().__init__(sock.getsockname()[:2], _ProbeHandler, listening=sock)
        self.state, self.wedged_s, self.device = state, wedged_s, device

    def _read(self) -> tuple[float, bool]:
        """(seconds since the loop last turned, whether the server started); read until two reads
        agree, so a write under way is never taken half."""
        while True:
            first, again = STATE.unpack_from(self.state), STATE.unpack_from(self.state)
            if first == again:
                return max(0.0, (time.monotonic_ns() - first[0]) / 1e9), bool(first[1])

    def health(self) -> tuple[int, dict[str, Any]]:
        still, _ = self._read()
        if still >= self.wedged_s:
            return 503, _error(f"the event loop has not turned for {still:.1f} s (wedged after {self.wedged_s:g} s)")
        return 200, {"status": "ok", "loop_still_s": round(still, 3)}

    def readiness(self) -> tuple[int, dict[str, Any]]:
        status, body = self.health()
        if status != 200:
            return status, body
        if not self._read()[1]:
            return 503, _error("weightsvc is starting")
        return 200, {"status": "ready", "device": self.device}


def _error(message: str) -> dict[str, Any]:
    return {"error": {"code": "UNAVAILABLE", "message": message}}  # (the HTTP port's error body)


def main(argv: list[str]) -> None:
    listen_fd, state_fd, alive_fd = (int(a) for a in argv[:3])
    wedged_s, device = float(argv[3]), argv[4]
    state = mmap.mmap(state_fd, STATE.size, access=mmap.ACCESS_READ)
    server = _ProbeServer(socket.socket(fileno=listen_fd), state, wedged_s, device)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while os.read(alive_fd, 1):  # the server writes nothing: this returns at its end
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
