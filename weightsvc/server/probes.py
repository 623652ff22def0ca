"""`/healthz` and `/readyz` answered off the event loop, on a port of their own (`--probe-port`, plain
HTTP, no token), so a push or pull that keeps the loop busy for a while (a 100,000-tensor push, a
1 GiB sync to 8 pullers) never fails a Kubernetes probe, whose timeout is 1 s by default. The HTTP
port answers the same two paths from the loop, as it always has.

They are answered by a small process of their own (`_probe_process`), not a thread: a thread of the
server would wait for its GIL, which a busy worker keeps for as long as the kernel leaves it off a
core, and for its memory-map lock, which a worker populating a buffer takes; a process waits for a
core alone. The server tells the process what it needs in
16 bytes of shared memory: when its event loop last turned (the loop monitor's every wake-up) and
whether it has started. The process ends when the server does (its end of a pipe closes, even on
SIGKILL).

What they answer: `/healthz` is 200 while the event loop turns, `/readyz` while it turns and the server
has started. A loop busy for a second or two still turns; one that has not turned for `--loop-wedged-s`
is wedged (every transport, watch and commit stalls behind it): both answer 503 and say how long, so
Kubernetes takes the pod out of its Service and then restarts it."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["STATE", "Probes"]

STATE = struct.Struct("<qq")  # when the loop last turned (time.monotonic_ns), started (0 or 1)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class Probes:
    """The server's side of the probes: the shared state it writes, and the process that answers."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="weightsvc-probes-")  # noqa: SIM115 (closed by stop)
        self._file.truncate(STATE.size)
        self._state = mmap.mmap(self._file.fileno(), STATE.size)
        self._started = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._alive_w: int | None = None
        self.turned()

    def turned(self) -> None:
        """The event loop turned (called on it, by its monitor)."""
        STATE.pack_into(self._state, 0, time.monotonic_ns(), self._started)

    def ready(self, started: bool) -> None:
        self._started = int(started)
        self.turned()

    def start(self, host: str, port: int, device: str, wedged_s: float) -> int:
        """Bind `host:port` (0 picks one) and start the process that answers there; the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
            alive_r, self._alive_w = os.pipe()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT,
                                                                               os.environ.get("PYTHONPATH")]))}
            self._process = subprocess.Popen(
                [sys.executable, "-m", "weightsvc.server._probe_process", str(sock.fileno()),
                 str(self._file.fileno()), str(alive_r), f"{wedged_s!r}", device],
                pass_fds=(sock.fileno(), self._file.fileno(), alive_r), env=env, stdin=subprocess.DEVNULL,
                start_new_session=True)  # (a Ctrl-C to the server's terminal is the server's to handle)
            os.close(alive_r)
            return int(sock.getsockname()[1])

    def stop(self) -> None:
        if self._alive_w is not None:
            os.close(self._alive_w)  # the process sees the end of the pipe and exits
            self._alive_w = None
        if self._process is not None:
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._state.close()
        self._file.close()
