"""N1: a version pulled over NIXL (`InferenceClient.pull_into`: lease, READ, release, every checksum)
from a `serve --nixl` process, vs a bare NIXL READ of the same number of bytes between two processes
with no weightsvc in between (one registered buffer, one descriptor). Both readers read into memory
they registered before, on loopback (UCX picks shared memory here; RDMA or NVLink on a fleet).

The processes: `python -m weightsvc.cli.bench.fabric source NBYTES META` (the bare source: a
registered buffer, its agent's metadata and address written to META), `... bare META REPEAT` and
`... pull TARGET REPEAT` (the readers: `ready`, then on a line of stdin the best of REPEAT reads in
seconds).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from weightsvc.cli.bench._common import row, serve


def fabric_bench(*, size_mib: int, repeat: int, say: Any) -> dict[str, Any]:
    """N1 on a version of `size_mib` served (bf16) bytes."""
    from weightsvc.cli.bench._common import make_model
    from weightsvc.client import InferenceClient, LearnerClient

    server = serve(1, "--nixl")
    try:
        LearnerClient(server.target).push(1, make_model(2 * size_mib))  # fp32 masters: twice the served bytes
        nbytes = InferenceClient(server.url).manifest().data_bytes
        pull_s = _reader(["pull", server.target, str(repeat)])
    finally:
        server.stop()
    with tempfile.TemporaryDirectory() as tmp:
        meta = Path(tmp) / "source"
        source = subprocess.Popen([sys.executable, "-m", __name__, "source", str(nbytes), str(meta)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert source.stdout is not None
            source.stdout.readline()  # registered, its metadata written
            bare_s = _reader(["bare", str(meta), str(repeat)])
        finally:
            source.communicate("", timeout=60)
    n1 = bare_s / pull_s
    say(f"N1: pull over NIXL {nbytes / pull_s / 1e9:.2f} GB/s vs a bare NIXL READ {nbytes / bare_s / 1e9:.2f} GB/s "
        f"({nbytes / 2**20:.0f} MiB): {n1:.2f}x")
    return {
        "N1": round(n1, 3),
        "details": {"N1_seconds": {"pull": round(pull_s, 4), "bare_read": round(bare_s, 4), "bytes": nbytes}},
        "report": {"N1": row(f"pull over NIXL vs a bare NIXL READ ({nbytes / 2**20:.0f} MiB)", f"{n1:.2f}x",
                             ">= 0.9x")},
    }


def _reader(args: list[str]) -> float:
    proc = subprocess.Popen([sys.executable, "-m", __name__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    if ready.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"N1's reader {args[0]} did not start: {ready!r}")
    out, _ = proc.communicate("go\n", timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"N1's reader {args[0]} failed ({proc.returncode}): {out!r}")
    return float(out.split()[-1])


def _best(repeat: int, once: Any) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return min(times)


def _source(nbytes: int, meta: str) -> None:
    import torch

    from weightsvc.protocol.fabric import nixl_agent_class

    agent = nixl_agent_class()("bench-source")
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    agent.register_memory([buffer])
    Path(meta).write_bytes(buffer.data_ptr().to_bytes(8, "little") + nbytes.to_bytes(8, "little")
                           + agent.get_agent_metadata())
    print("ready", flush=True)
    sys.stdin.read()


def _bare(meta: str, repeat: int) -> None:
    import torch

    from weightsvc.protocol.fabric import nixl_agent_class

    agent = nixl_agent_class()("bench-bare")
    raw = Path(meta).read_bytes()
    addr, nbytes = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little")
    peer = agent.add_remote_agent(raw[16:])
    into = torch.empty(nbytes, dtype=torch.uint8)
    agent.register_memory([into])
    local = agent.get_xfer_descs([into])
    remote = agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")

    def once() -> None:
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"bare READ: {state}")

    once()  # the connection made before the clock starts, as the pull's warm-up makes it
    print("ready", flush=True)
    sys.stdin.readline()
    print(_best(repeat, once), flush=True)


def _pull(target: str, repeat: int) -> None:
    import torch

    from weightsvc.client import InferenceClient
    from weightsvc.client._tensors import TORCH_DTYPES

    client = InferenceClient(target)
    m = client.manifest()
    into = {t.name: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype]) for t in m.tensors}
    client.pull_into(into, fallback=False)  # this process's agent made before the clock starts
    print("ready", flush=True)
    sys.stdin.readline()
    print(_best(repeat, lambda: client.pull_into(into, fallback=False)), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "source":
        _source(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "bare":
        _bare(sys.argv[2], int(sys.argv[3]))
    else:
        _pull(sys.argv[2], int(sys.argv[3]))
