"""`/healthz` and `/readyz` answered off the event loop, on a port of their own (`--probe-port`, plain
HTTP, no token): a thread serves them, so a push or pull that keeps the loop busy for a while (a
100,000-tensor push, a 1 GiB sync to 8 pullers) never fails a Kubernetes probe, whose timeout is 1 s
by default. The HTTP port answers the same two paths from the loop, as it always has.

What they answer, from the loop monitor's heartbeat: `/healthz` is 200 while the event loop turns,
`/readyz` while it turns and the server has started. A loop busy for a second or two still turns; one
that has not turned for `--loop-wedged-s` is wedged (every transport, watch and commit stalls behind
it): both answer 503 and say how long, so Kubernetes takes the pod out of its Service and then
restarts it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from weightsvc._small_http import SmallHttpServer
from weightsvc.server.loop import Heartbeat

__all__ = ["Probes"]


class Probes:
    """The probes' answers, and the thread that serves them (`start`, `stop`)."""

    def __init__(self, heartbeat: Heartbeat, is_ready: Callable[[], bool], device: Callable[[], str],
                 wedged_s: float) -> None:
        self.heartbeat = heartbeat
        self.is_ready = is_ready
        self.device = device
        self.wedged_s = wedged_s
        self._http: SmallHttpServer | None = None

    def health(self) -> tuple[int, dict[str, Any]]:
        still = self.heartbeat.still_s()
        if still >= self.wedged_s:
            return 503, _error(f"the event loop has not turned for {still:.1f} s (wedged after "
                               f"{self.wedged_s:g} s)")
        return 200, {"status": "ok", "loop_still_s": round(still, 3)}

    def readiness(self) -> tuple[int, dict[str, Any]]:
        status, body = self.health()
        if status != 200:
            return status, body
        if not self.is_ready():
            return 503, _error("weightsvc is starting")
        return 200, {"status": "ready", "device": self.device()}

    def start(self, host: str, port: int) -> int:
        """Serve the probes on `host:port` (0 picks one); the port."""
        self._http = SmallHttpServer((host, port), _ProbeHandler)
        self._http.probes = self  # type: ignore[attr-defined]
        threading.Thread(target=self._http.serve_forever, name="weightsvc-probes", daemon=True).start()
        return int(self._http.server_address[1])

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def _error(message: str) -> dict[str, Any]:
    return {"error": {"code": "UNAVAILABLE", "message": message}}  # (the HTTP port's error body)


class _ProbeHandler(BaseHTTPRequestHandler):
    server: Any  # the SmallHttpServer, with its probes

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._answer(*self.server.probes.health())
        elif self.path == "/readyz":
            self._answer(*self.server.probes.readiness())
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
