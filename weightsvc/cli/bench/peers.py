"""The pullers of T3, scale_3v1 and E1, each in a process of its own, as an inference fleet's are:
`python -m weightsvc.cli.bench.peers pull` (told its targets on stdin) or `... watch TARGET AFTER`; and E1's reference
reader of safetensors files (`... files`). This module imports
the client only in the peer, so the bench's side starts no more than it needs."""

from __future__ import annotations

import subprocess
import sys
import time


def _pull() -> None:
    """Pulls the latest version of each target it is sent on stdin, verified: it connects to the target,
    prints `ready`, waits for a line, pulls, and prints the pull's start and end on the system-wide
    monotonic clock. One process serves every round of a bench (its start-up is not timed anyway)."""
    from weightsvc.client import InferenceClient, tensors_from_data

    for line in sys.stdin:
        with InferenceClient(line.strip()) as client:
            client.manifest()  # connected before the clock starts
            print("ready", flush=True)
            sys.stdin.readline()
            start = time.monotonic()
            tensors_from_data(*client.pull_data())
            print(start, time.monotonic(), flush=True)


def _watch(target: str, after: int) -> None:
    """Pulls each version after `after` as the watch announces it, verified, and prints when it holds
    it (the system-wide monotonic clock)."""
    from weightsvc.client import InferenceClient

    client = InferenceClient(target)
    for info in client.watch(after=after):
        tensors = client.pull(version=info.version)
        print(info.version, time.monotonic(), flush=True)
        del tensors


def _read_files() -> None:
    """The reader of the reference sync without a service: loads each safetensors file named on stdin
    into memory, and prints when it holds it (the system-wide monotonic clock)."""
    from safetensors.torch import load_file

    print("ready", flush=True)
    for line in sys.stdin:
        tensors = load_file(line.strip())
        print(time.monotonic(), flush=True)
        del tensors


def _start(*args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "weightsvc.cli.bench.peers", *args], stdin=stdin,
                            stdout=subprocess.PIPE, text=True)


def start_watchers(target: str, after: int, n: int) -> list[subprocess.Popen[str]]:
    """`n` watching pullers of `target` that hold version `after` already."""
    return [_start("watch", target, str(after)) for _ in range(n)]


class Pullers:
    """`n` puller processes, started once, each pulling whole versions when told to."""

    def __init__(self, n: int) -> None:
        self.procs = [_start("pull", stdin=subprocess.PIPE) for _ in range(n)]

    def __enter__(self) -> Pullers:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()

    def _tell(self, line: str) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def _answer(self, p: subprocess.Popen[str]) -> str:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a puller failed (exit code {p.wait(60)})")
        return line.strip()

    def seconds(self, target: str) -> float:
        """Wall seconds for every puller to pull the latest version of `target` at once (first start to
        last end)."""
        self._tell(target)
        if any(self._answer(p) != "ready" for p in self.procs):
            raise RuntimeError("a puller did not connect")
        self._tell("go")
        spans = [tuple(map(float, self._answer(p).split())) for p in self.procs]
        return max(end for _, end in spans) - min(start for start, _ in spans)


def start_file_reader() -> subprocess.Popen[str]:
    """A reader process, ready, that loads each safetensors file whose path it is sent."""
    p = _start("files", stdin=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


if __name__ == "__main__":
    if sys.argv[1] == "pull":
        _pull()
    elif sys.argv[1] == "files":
        _read_files()
    else:
        _watch(sys.argv[2], int(sys.argv[3]))
