"""The process that answers a server's probes (`probes`), started by it with: the listening socket's
descriptor, the shared state's, a pipe's read end (its end: the server is gone), the wedged bound in
seconds, the export device. It imports the standard library and `probes` alone (it starts in a
fraction of a second and holds a few MiB), and serves on one thread with asyncio: an answer is one
wake-up of one thread, however busy the machine (no thread started per connection)."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import socket
import sys
import time
from typing import Any

from weightsvc.server.probes import STATE

DEADLINE_S = 5.0  # for a connection's one request and answer
MAX_CONNECTIONS = 1000  # served at once (an idle one costs a few KiB); more are closed as they come
MAX_HEADERS = 100


class ProbeAnswers:
    def __init__(self, state: mmap.mmap, wedged_s: float, device: str) -> None:
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

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/healthz":
            return self.health()
        if path == "/readyz":
            return self.readiness()
        return 404, {"error": {"code": "NOT_FOUND", "message": f"no route GET {path[:64]}: this port answers "
                                                                 "/healthz and /readyz"}}


def _error(message: str) -> dict[str, Any]:
    return {"error": {"code": "UNAVAILABLE", "message": message}}  # (the HTTP port's error body)


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


async def serve(sock: socket.socket, answers: ProbeAnswers, alive_fd: int) -> None:
    open_now = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_now
        open_now += 1
        try:
            if open_now > MAX_CONNECTIONS:
                return
            async with asyncio.timeout(DEADLINE_S):
                request = (await reader.readline()).split()
                for _ in range(MAX_HEADERS):
                    if (await reader.readline()).strip() == b"":
                        break
                if len(request) != 3 or not request[2].startswith(b"HTTP/"):
                    status, body = 400, {"error": {"code": "INVALID_ARGUMENT", "message": "not an HTTP request"}}
                elif request[0] not in (b"GET", b"HEAD"):
                    status, body = 405, {"error": {"code": "INVALID_ARGUMENT", "message": "GET /healthz or /readyz"}}
                else:
                    status, body = answers.get(request[1].decode("latin-1"))
                data = json.dumps(body).encode()
                head = f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n" \
                       f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                writer.write(head.encode() + (b"" if request[:1] == [b"HEAD"] else data))
                await writer.drain()
        except (TimeoutError, OSError, ValueError, asyncio.CancelledError):
            pass  # slow, gone, a line over the reader's limit; or the server has gone and this process ends
        finally:
            open_now -= 1
            writer.close()

    loop = asyncio.get_running_loop()
    gone = asyncio.Event()

    def server_gone() -> None:  # readable: the server's end closed (it writes nothing)
        if not os.read(alive_fd, 1):
            loop.remove_reader(alive_fd)
            gone.set()

    loop.add_reader(alive_fd, server_gone)
    async with await asyncio.start_server(answer, sock=sock, limit=8 << 10):
        await gone.wait()


def main(argv: list[str]) -> None:
    listen_fd, state_fd, alive_fd = (int(a) for a in argv[:3])
    state = mmap.mmap(state_fd, STATE.size, access=mmap.ACCESS_READ)
    asyncio.run(serve(socket.socket(fileno=listen_fd), ProbeAnswers(state, float(argv[3]), argv[4]), alive_fd))


if __name__ == "__main__":
    main(sys.argv[1:])
