"""The pullers of T3, scale_3v1 and E1, each in a process of its own, as an inference fleet's are:
`python -m weightsvc.cli.bench.peers pull TARGET` or `... watch TARGET AFTER`; and E1's reference
reader of safetensors files (`... files`). This module imports
the client only in the peer, so the bench's side starts no more than it needs."""

from __future__ import annotations

import subprocess
import sys
import time


def _pull(target: str) -> None:
    """Pulls the latest version when told to on stdin, verifies it, and prints its start and end on the
    system-wide monotonic clock."""
    from weightsvc.client import InferenceClient, tensors_from_data

    client = InferenceClient(target)
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


def fanout_pull_seconds(target: str, pullers: int) -> float:
    """Wall seconds for `pullers` processes to pull the latest version at once (first start to last end)."""
    procs = [_start("pull", target, stdin=subprocess.PIPE) for _ in range(pullers)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        spans = [tuple(map(float, p.stdout.readline().split())) for p in procs if p.stdout is not None]
        if any(p.wait(120) != 0 for p in procs) or len(spans) != pullers:
            raise RuntimeError("a puller failed")
    finally:
        for p in procs:
            p.kill()
    return max(end for _, end in spans) - min(start for start, _ in spans)


def start_file_reader() -> subprocess.Popen[str]:
    """A reader process, ready, that loads each safetensors file whose path it is sent."""
    p = _start("files", stdin=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


if __name__ == "__main__":
    if sys.argv[1] == "pull":
        _pull(sys.argv[2])
    elif sys.argv[1] == "files":
        _read_files()
    else:
        _watch(sys.argv[2], int(sys.argv[3]))
