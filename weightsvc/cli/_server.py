"""`weightsvc serve` as a process of its own, on ports 0, as users run it: what the tests, the bench
and the scripts start a server with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from weightsvc.memory import process_status

# The installed command where there is one (it is what users run), else the module.
WEIGHTSVC = Path(sys.executable).with_name("weightsvc")
WEIGHTSVC_CMD = [str(WEIGHTSVC)] if WEIGHTSVC.exists() else [sys.executable, "-m", "weightsvc"]


class ServeProcess:
    """A started `weightsvc serve ARGS`, ready: its ready line read, both servers listening.

    `capture_stderr`: its log goes to `proc.stderr` (read it once it has stopped) instead of this
    process's stderr; a long run that logs a lot and is not read would fill the pipe and block."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, capture_stderr: bool = True) -> None:
        self.proc = subprocess.Popen(
            [*WEIGHTSVC_CMD, "serve", "--grpc-port", "0", "--http-port", "0", "--probe-port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if capture_stderr else None,
            text=True,
            env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the ready line, printed once both servers listen
        if not line.startswith("weightsvc ready "):
            self.proc.kill()
            _, log = self.proc.communicate()
            raise RuntimeError(f"weightsvc serve did not start: {line!r} {log or ''}")
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        self.target, self.url, self.probes = fields["grpc"], fields["http"], fields["probes"]

    def memory(self) -> dict[str, int]:
        """The server's sizes from /proc (VmRSS, VmHWM, RssAnon, ...), in bytes."""
        return process_status(self.proc.pid)

    def stop(self) -> int:
        """SIGTERM, a clean shutdown; its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a power cut."""
        self.proc.kill()
        self.proc.wait(30)

    def died(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)
