"""The fabric data plane's figures, each against bare NIXL READs between processes with no weightsvc in
between, on loopback (UCX picks shared memory here; RDMA or NVLink on a fleet):
- N1: a version pulled over NIXL (`InferenceClient.pull_into`: lease, READ, release, every checksum)
  from a `serve --nixl` process, vs a bare READ of as many bytes (one registered buffer, one descriptor).
- N2: 4 reader processes each pulling a quarter of the rows of every tensor (a selection: its own
  lease, one descriptor per tensor, the selection's checksums), all at once, vs 4 bare readers READing
  the same byte ranges of a buffer laid out as the version: the time until the last one is done.
- N3: the control plane per version (no ratio): commit -> 4 readers hold their leases (descriptors),
  and one lease over gRPC and over HTTP, at 1,000 and 100,000 tensors, beside the NIXL pull of the
  same version.

The processes: `python -m weightsvc.cli.bench.fabric source NBYTES META` (the bare source: a
registered buffer, its agent's metadata and address written to META), `... bare META REPEAT` and
`... pull TARGET REPEAT` (N1's readers: `ready`, then on a line of stdin the best of REPEAT reads in
seconds), `... quarter TARGET I N` and `... bare-quarter META MANIFEST I N` (N2's: `ready`, then one
read per line of stdin, its seconds).
"""

from __future__ import annotations

import json
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


N2_READERS = 4


def quarters_bench(*, size_mib: int, repeat: int, say: Any) -> dict[str, Any]:
    """N2 on a version of `size_mib` served (bf16) bytes."""
    from weightsvc.cli.bench._common import make_model
    from weightsvc.client import InferenceClient, LearnerClient

    server = serve(1, "--nixl")
    try:
        LearnerClient(server.target).push(1, make_model(2 * size_mib))
        manifest = InferenceClient(server.url).manifest()
        pull_s = _together([["quarter", server.target, str(i), str(N2_READERS)] for i in range(N2_READERS)], repeat)
    finally:
        server.stop()
    nbytes = manifest.data_bytes
    with tempfile.TemporaryDirectory() as tmp:
        meta, layout = Path(tmp) / "source", Path(tmp) / "manifest.json"
        layout.write_text(manifest.json())
        source = subprocess.Popen([sys.executable, "-m", __name__, "source", str(nbytes), str(meta)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert source.stdout is not None
            source.stdout.readline()
            bare_s = _together([["bare-quarter", str(meta), str(layout), str(i), str(N2_READERS)]
                                for i in range(N2_READERS)], repeat)
        finally:
            source.communicate("", timeout=60)
    n2 = bare_s / pull_s
    say(f"N2: {N2_READERS} readers of a quarter of the rows each, over NIXL {nbytes / pull_s / 1e9:.2f} GB/s vs bare "
        f"READs {nbytes / bare_s / 1e9:.2f} GB/s ({nbytes / 2**20:.0f} MiB, {len(manifest.tensors)} tensors): "
        f"{n2:.2f}x")
    return {
        "N2": round(n2, 3),
        "details": {"N2_seconds": {"pull": round(pull_s, 4), "bare_read": round(bare_s, 4), "bytes": nbytes}},
        "report": {"N2": row(f"{N2_READERS} readers, a quarter of the rows each, vs bare READs "
                             f"({nbytes / 2**20:.0f} MiB)", f"{n2:.2f}x", ">= 0.8x")},
    }


N3_MIB = 32  # fp32 masters of every version of N3, whatever its number of tensors


def control_bench(*, counts: tuple[int, ...], repeat: int, say: Any) -> dict[str, Any]:
    """N3: the control plane's cost per version at each number of tensors in `counts`."""
    import concurrent.futures

    import torch

    from weightsvc.client import InferenceClient, LearnerClient

    gen = torch.Generator().manual_seed(0)
    elements = (N3_MIB << 20) // 4
    out: dict[str, dict[str, float]] = {}
    server = serve(1, "--nixl")
    try:
        learner = LearnerClient(server.target)
        grpc, http = InferenceClient(server.target), InferenceClient(server.url)
        readers = [InferenceClient(server.target) for _ in range(N2_READERS)]
        pool = concurrent.futures.ThreadPoolExecutor(N2_READERS)
        version = 0
        for count in counts:
            model = {f"t.{i}": t for i, t in enumerate((torch.randn(count, elements // count, generator=gen) * 0.02)
                                                       .unbind(0))}
            figures = _control(learner, (grpc, http), readers, pool, model, version + 1, repeat)
            version += repeat
            out[str(count)] = {k: round(v, 4) for k, v in figures.items()}
            say(f"N3: {count} tensors: commit -> {N2_READERS} readers leased {figures['commit_to_leases']:.3f} s; "
                f"a lease over gRPC {figures['lease_grpc']:.3f} s, HTTP {figures['lease_http']:.3f} s; the NIXL pull "
                f"of the version {figures['nixl_pull']:.3f} s")
        pool.shutdown()
        for c in (grpc, http, *readers):
            c.close()
    finally:
        server.stop()
    text = "; ".join(f"{n}: {f['commit_to_leases'] * 1e3:.0f} ms to {N2_READERS} leases, lease gRPC "
                     f"{f['lease_grpc'] * 1e3:.0f} / HTTP {f['lease_http'] * 1e3:.0f} ms, NIXL pull "
                     f"{f['nixl_pull'] * 1e3:.0f} ms" for n, f in out.items())
    return {
        "N3": out,
        "details": {"N3_mib": N3_MIB},
        "report": {"N3": row(f"control plane per version ({N3_MIB} MiB fp32 masters)", text, "reported")},
    }


def _control(learner: Any, clients: tuple[Any, Any], readers: list[Any], pool: Any, model: dict[str, Any],
             first: int, repeat: int) -> dict[str, float]:
    """N3 at one number of tensors: versions `first`, `first + 1`, ... pushed, `repeat` of them."""
    import torch

    from weightsvc.client._tensors import TORCH_DTYPES

    grpc, http = clients
    took = []
    for version in range(first, first + repeat):
        learner.push(version, model)  # committed when it returns
        start = time.perf_counter()
        leases = list(pool.map(lambda c, v=version: c._lease("default", str(v), None, 60.0), readers))
        took.append(time.perf_counter() - start)
        for c, lent in zip(readers, leases, strict=True):
            c._release(lent.lease_id)
    version = first + repeat - 1

    def lease(client: Any) -> None:
        client._release(client._lease("default", str(version), None, 60.0).lease_id)

    m = grpc.manifest(version=version)
    into = {t.name: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype]) for t in m.tensors}
    grpc.pull_into(into, version=version, fallback=False)  # the connection made before the clock starts
    return {"commit_to_leases": min(took), "lease_grpc": _best(repeat, lambda: lease(grpc)),
            "lease_http": _best(repeat, lambda: lease(http)),
            "nixl_pull": _best(repeat, lambda: grpc.pull_into(into, version=version, fallback=False))}


def _together(commands: list[list[str]], repeat: int, module: str = __name__) -> float:
    """Reader processes (`python -m module`) told to read at once, best of `repeat`: the time until the last
    one is done."""
    procs = [subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for args in commands]
    try:
        for proc, args in zip(procs, commands, strict=True):
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a reader {args[0]} did not start")
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            for proc, args in zip(procs, commands, strict=True):
                assert proc.stdout is not None
                if not proc.stdout.readline().strip():
                    raise RuntimeError(f"a reader {args[0]} failed ({proc.wait()})")
            times.append(time.perf_counter() - start)
        return min(times)
    finally:
        for proc in procs:
            proc.communicate("", timeout=60)


def _rows(manifest: Any, index: int, count: int) -> dict[str, Any]:
    """The selection of reader `index` of `count`: its share of the rows of every tensor (whole when it
    has fewer rows than readers)."""
    from weightsvc.protocol.manifest import Slice

    out: dict[str, Any] = {}
    for t in manifest.tensors:
        rows = t.shape[0] if t.shape else 0
        out[t.name] = Slice(0, index * rows // count, (index + 1) * rows // count) if rows >= count else None
    return out


def _quarter(target: str, index: int, count: int) -> None:
    import torch

    from weightsvc.client import InferenceClient
    from weightsvc.client._tensors import TORCH_DTYPES
    from weightsvc.protocol.selection import sliced_shape

    client = InferenceClient(target)
    m = client.manifest()
    select = _rows(m, index, count)
    into = {t.name: torch.empty(sliced_shape(t.shape, select[t.name]), dtype=TORCH_DTYPES[t.dtype])
            for t in m.tensors}
    client.pull_into(into, select=select, fallback=False)  # this process's agent made before the clock starts
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        client.pull_into(into, select=select, fallback=False)
        print(time.perf_counter() - start, flush=True)


def _bare_quarter(meta: str, layout: str, index: int, count: int) -> None:
    import torch

    from weightsvc.protocol.fabric import new_agent
    from weightsvc.protocol.manifest import Manifest
    from weightsvc.protocol.selection import byte_ranges

    m = Manifest.from_dict(json.loads(Path(layout).read_text()))
    agent = new_agent(f"bench-bare-{index}")
    raw = Path(meta).read_bytes()
    addr = int.from_bytes(raw[:8], "little")
    peer = agent.add_remote_agent(raw[16:])
    select = _rows(m, index, count)
    ranges = [r for t in m.tensors for r in byte_ranges(t, select[t.name])]
    into = torch.empty(sum(n for _, n in ranges), dtype=torch.uint8)
    agent.register_memory([into])
    local, at = [], into.data_ptr()
    for _, n in ranges:
        local.append((at, n, 0))
        at += n
    local_descs = agent.get_xfer_descs(local, "DRAM")
    remote = agent.get_xfer_descs([(addr + o, n, 0) for o, n in ranges], "DRAM")

    def once() -> None:
        _read(agent, local_descs, remote, peer, "bare READ")

    once()
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        once()
        print(time.perf_counter() - start, flush=True)


def vram_bench(*, size_mib: int, repeat: int) -> dict[str, Any]:
    """On a CUDA machine (scripts/gpu_check.sh): a NIXL READ from VRAM to VRAM between two processes on
    one GPU, its bytes compared with the source's, against a device copy of as many bytes in one
    process; and `pull_into` of a `serve --nixl` version into tensors on the GPU (READ into VRAM,
    checksums on host copies), compared with a pull over TCP."""
    import torch

    from weightsvc.cli.bench._common import make_model
    from weightsvc.client import InferenceClient, LearnerClient
    from weightsvc.client._tensors import TORCH_DTYPES

    nbytes = size_mib << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    copy_s = _best(repeat, copy)
    with tempfile.TemporaryDirectory() as tmp:
        meta = Path(tmp) / "source"
        source = subprocess.Popen([sys.executable, "-m", __name__, "vram-source", str(nbytes), str(meta)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert source.stdout is not None
            source.stdout.readline()
            read_s = _reader(["vram-read", str(meta), str(repeat)])
        finally:
            source.communicate("", timeout=60)
    server = serve(1, "--nixl")
    try:
        LearnerClient(server.target).push(1, make_model(2 * min(size_mib, 256)))
        with InferenceClient(server.target) as client:
            m = client.manifest()
            into = {t.name: torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device="cuda") for t in m.tensors}
            client.pull_into(into, fallback=False)
            pulled = client.pull()
            same = all(torch.equal(into[n].cpu().view(torch.uint8), t.view(torch.uint8)) for n, t in pulled.items())
    finally:
        server.stop()
    return {"nixl_vram_read_vs_device_copy": round(copy_s / read_s, 3),
            "nixl_vram_read_gbps": round(nbytes / read_s / 1e9, 2), "device_copy_gbps": round(nbytes / copy_s / 1e9, 2),
            "pull_into_vram_bits_equal": same}


def _vram_source(nbytes: int, meta: str) -> None:
    import torch

    from weightsvc.protocol.fabric import new_agent

    agent = new_agent("bench-vram-source")
    gen = torch.Generator().manual_seed(0)
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).cuda()
    agent.register_memory([buffer])
    Path(meta).write_bytes(buffer.data_ptr().to_bytes(8, "little") + nbytes.to_bytes(8, "little")
                           + torch.cuda.current_device().to_bytes(8, "little") + agent.get_agent_metadata())
    print("ready", flush=True)
    sys.stdin.read()


def _vram_read(meta: str, repeat: int) -> None:
    """READs into VRAM (`ready`, then on a line of stdin the best of REPEAT in seconds); fails unless the
    bytes are the source's (the same generator's)."""
    import torch

    from weightsvc.protocol.fabric import new_agent

    agent = new_agent("bench-vram-read")
    raw = Path(meta).read_bytes()
    addr, nbytes, device = (int.from_bytes(raw[i : i + 8], "little") for i in (0, 8, 16))
    peer = agent.add_remote_agent(raw[24:])
    into = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    agent.register_memory([into])
    local = agent.get_xfer_descs([into])
    remote = agent.get_xfer_descs([(addr, nbytes, device)], "VRAM")

    def once() -> None:
        _read(agent, local, remote, peer, "VRAM READ")

    once()
    gen = torch.Generator().manual_seed(0)
    if not torch.equal(into.cpu(), torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)):
        raise RuntimeError("the VRAM READ brought other bytes than the source's")
    print("ready", flush=True)
    sys.stdin.readline()
    print(_best(repeat, once), flush=True)


def _read(agent: Any, local: Any, remote: Any, peer: Any, what: str) -> None:
    """One bare NIXL READ of `remote` into `local`, polled to its end (the bench's references)."""
    handle = agent.initialize_xfer("READ", local, remote, peer)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"{what}: {state}")


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

    from weightsvc.protocol.fabric import new_agent

    agent = new_agent("bench-source")
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    agent.register_memory([buffer])
    Path(meta).write_bytes(buffer.data_ptr().to_bytes(8, "little") + nbytes.to_bytes(8, "little")
                           + agent.get_agent_metadata())
    print("ready", flush=True)
    sys.stdin.read()


def _bare(meta: str, repeat: int) -> None:
    import torch

    from weightsvc.protocol.fabric import new_agent

    agent = new_agent("bench-bare")
    raw = Path(meta).read_bytes()
    addr, nbytes = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little")
    peer = agent.add_remote_agent(raw[16:])
    into = torch.empty(nbytes, dtype=torch.uint8)
    agent.register_memory([into])
    local = agent.get_xfer_descs([into])
    remote = agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")

    def once() -> None:
        _read(agent, local, remote, peer, "bare READ")

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
    elif sys.argv[1] == "quarter":
        _quarter(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "vram-source":
        _vram_source(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "vram-read":
        _vram_read(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "bare-quarter":
        _bare_quarter(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        _pull(sys.argv[2], int(sys.argv[3]))
