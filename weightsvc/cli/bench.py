"""`weightsvc bench`: the performance figures as ratios against a baseline measured in the same run.

Transfer part (this module): the service runs as a separate process, as it does in production.
- T2: push an fp32 model until committed (export included) vs raw TCP loopback on the same bytes.
- T1: pull the committed version (gRPC and HTTP, checksums verified) vs raw TCP on the served bytes.
- T3: 8 puller processes at once, aggregate, vs 8 raw TCP streams from one process at once.
- M1: the server's peak RSS against 1.25 x retained bytes + 300 MiB.
- E1: sync time, from the learner's push call until N watching puller processes hold the version,
  vs the raw-TCP lower bound: the masters up, then the served bytes down (to N at once).
- S1: push + pull time per tensor, from the same total size split into more and more tensors.
- S2: the server's anonymous RSS with --data-dir against the bytes it retains, for several --retain.
- P1: the clients' pull into memory vs raw TCP into a preallocated buffer; for reference, the same
  file from nginx (sendfile) to the same client.
- L1: how long the server's event loop was blocked, at most, in each of the above.
- scale_3v1: 8 pullers at once from 3 sharded replicas (on Redis) vs from 1 replica, aggregate.
Raw TCP is two Python processes moving a preallocated buffer with sendall/recv_into: the best a
Python peer can do on this machine, so a ratio of 1.0 means "as fast as the socket".
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightsvc.client import InferenceClient, LearnerClient, tensors_from_data
from weightsvc.memory import alloc

TENSOR_MIB = 16  # a typical transformer matrix (2048 x 2048 fp32)
TARGETS = {"T1": 0.5, "T2": 0.4, "T3": 0.4}
PULLERS = 8
_RECV_PIECE = 4 << 20


def _recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got : got + _RECV_PIECE])
        if n == 0:
            raise ConnectionError("peer closed early")
        got += n


def _fresh(nbytes: int) -> memoryview:
    return alloc(nbytes)  # as the clients allocate their receive buffers: both pay the same


# The other end of the raw-TCP baseline, in its own process (argv: port, nbytes, send|recv).
_PEER = """
import socket, sys
port, nbytes, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
buf = memoryview(bytearray(nbytes))
with socket.create_connection(("127.0.0.1", port)) as s:
    if mode == "send":
        s.sendall(buf)
    else:
        got = 0
        while got < nbytes:
            n = s.recv_into(buf[got:got + (4 << 20)])
            if not n:
                raise SystemExit("sender closed early")
            got += n
        s.sendall(b"k")  # every byte is in: the clock stops here
"""


def raw_tcp_seconds(nbytes: int, *, download: bool) -> float:
    """Seconds to move `nbytes` over loopback between two processes (download: the peer sends)."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        port = ls.getsockname()[1]
        peer = subprocess.Popen([sys.executable, "-c", _PEER, str(port), str(nbytes), "send" if download else "recv"])
        conn, _ = ls.accept()
        with conn:
            if download:
                buf = _fresh(nbytes)  # outside the clock: the baseline is the socket alone
                start = time.perf_counter()
                _recv_exactly(conn, buf)
            else:
                buf = torch.ones(nbytes, dtype=torch.uint8).numpy().data
                start = time.perf_counter()
                conn.sendall(buf)
                conn.recv(1)
            elapsed = time.perf_counter() - start
        if peer.wait(60) != 0:
            raise RuntimeError("raw TCP peer failed")
    return elapsed


def raw_tcp_fanout_seconds(nbytes: int, peers: int) -> float:
    """Seconds for one process to send `nbytes` to each of `peers` receiving processes at once."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(peers)
        port = ls.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, "-c", _PEER, str(port), str(nbytes), "recv"]) for _ in range(peers)]
        conns = [ls.accept()[0] for _ in range(peers)]
        buf = torch.ones(nbytes, dtype=torch.uint8).numpy().data

        def send(conn: socket.socket) -> None:
            conn.sendall(buf)  # releases the GIL: the streams run in parallel, as a server's would
            conn.recv(1)

        threads = [threading.Thread(target=send, args=(c,)) for c in conns]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        for c in conns:
            c.close()
        if any(p.wait(60) != 0 for p in procs):
            raise RuntimeError("raw TCP peer failed")
    return elapsed


# One puller of T3, in its own process (argv: target): pulls the latest version when told to on
# stdin, verifies it, and prints its start and end on the system-wide monotonic clock.
_PULLER = """
import sys, time
from weightsvc.client import InferenceClient, tensors_from_data
client = InferenceClient(sys.argv[1])
client.manifest()  # connected before the clock starts
print("ready", flush=True)
sys.stdin.readline()
start = time.monotonic()
tensors_from_data(*client.pull_data())
print(start, time.monotonic(), flush=True)
"""


def fanout_pull_seconds(target: str, pullers: int) -> float:
    """Wall seconds for `pullers` processes to pull the latest version at once (first start to last end)."""
    procs = [subprocess.Popen([sys.executable, "-c", _PULLER, target], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(pullers)]
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


def _model(size_mib: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensor_mib = max(1, min(TENSOR_MIB, size_mib))
    n = max(1, size_mib // tensor_mib)
    side = max(1, ((tensor_mib << 20) // 4) // 2048)
    return {f"layers.{i}.weight": torch.randn(side, 2048, generator=gen) * 0.02 for i in range(n)}


class _ServerProcess:
    def __init__(self, retain: int, *args: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "weightsvc",
            "serve",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--retain",
            str(retain),
            "--log-level",
            "warning",
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until the service is ready
        if not line.startswith("weightsvc ready"):
            self.proc.kill()
            raise RuntimeError(f"weightsvc serve did not start: {line!r}")
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        self.grpc, self.http = fields["grpc"], fields["http"]

    def peak_rss_bytes(self) -> int:
        return self._status("VmHWM:")

    def rss_bytes(self) -> int:
        return self._status("VmRSS:")

    def anon_rss_bytes(self) -> int:
        """Resident anonymous memory: what the process itself holds, not the page cache of its files."""
        return self._status("RssAnon:")

    def loop_lag(self) -> list[tuple[float, float]]:
        """The event loop's lag histogram so far: (bucket bound, wake-ups up to it), cumulative."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.http}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return sorted(
            (float(s.labels["le"]), s.value)
            for f in text_string_to_metric_families(text)
            if f.name == "weightsvc_event_loop_lag_seconds"
            for s in f.samples
            if s.name.endswith("_bucket")
        )

    def loop_lag_max_s(self, since: list[tuple[float, float]] | None = None) -> float:
        """The longest the event loop was blocked (since the histogram `since`), rounded up to its bucket."""
        now = self.loop_lag()
        if since is not None:
            now = [(le, count - before) for (le, count), (_, before) in zip(now, since, strict=True)]
        total = now[-1][1]  # le="+Inf": every wake-up
        return next(le for le, count in now if count == total)

    def _status(self, field: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def scale_bench(*, size_mib: int = 512, repeat: int = 3, redis_url: str = "redis://127.0.0.1:6379/0",
                log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """scale_3v1: aggregate pull throughput of 8 pullers from 3 sharded replicas vs from 1 (each
    deployment on its own Redis prefix). Every puller asks replica 0 and gathers the parts from their
    owners, as InferenceClient does. None when no Redis answers at `redis_url`."""
    import redis

    say = log or (lambda _m: None)
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        say(f"scale_3v1: no Redis at {redis_url}; skipped")
        return {"scale_3v1": None}
    model = _model(size_mib)
    seconds = {}
    for count in (1, 3):
        prefix = f"weightsvc-bench-{os.getpid()}-{count}"
        servers = [_ServerProcess(2, "--redis-url", redis_url, "--redis-prefix", prefix, "--replica-id", f"r{i}")
                   for i in range(count)]
        try:
            with LearnerClient(servers[0].grpc) as learner:
                learner.push(1, model)
            seconds[count] = _best(lambda: fanout_pull_seconds(servers[0].grpc, PULLERS), repeat)  # noqa: B023
            served = InferenceClient(servers[0].grpc).manifest().data_bytes
            say(f"{PULLERS} pullers from {count} replica(s): {PULLERS * served / seconds[count] / 1e9:.2f} GB/s")
        finally:
            for server in servers:
                server.close()
            client = redis.Redis.from_url(redis_url)
            for key in client.scan_iter(f"{prefix}:*"):
                client.delete(key)
    gbps = {count: round(PULLERS * served / s / 1e9, 3) for count, s in seconds.items()}
    return {
        "scale_3v1": round(seconds[1] / seconds[3], 3),
        "details": {"scale_1_replica_gbps": gbps[1], "scale_3_replicas_gbps": gbps[3]},
    }


def _best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


class RawTcp:
    """The raw-TCP baselines of one run, each measured once (best of `repeat`) for all the figures
    that compare with it. Measured while no server runs."""

    def __init__(self, repeat: int) -> None:
        self.repeat = repeat
        self._seconds: dict[tuple[str, int], float] = {}

    def _get(self, key: tuple[str, int], fn: Callable[[], float]) -> float:
        if key not in self._seconds:
            self._seconds[key] = _best(fn, self.repeat)
        return self._seconds[key]

    def up(self, nbytes: int) -> float:
        return self._get(("up", nbytes), lambda: raw_tcp_seconds(nbytes, download=False))

    def down(self, nbytes: int) -> float:
        return self._get(("down", nbytes), lambda: raw_tcp_seconds(nbytes, download=True))

    def fanout(self, nbytes: int, peers: int) -> float:
        if peers == 1:
            return self.down(nbytes)
        return self._get((f"fanout{peers}", nbytes), lambda: raw_tcp_fanout_seconds(nbytes, peers))


def _torch_ops_sr(x: torch.Tensor) -> torch.Tensor:
    """SR to bf16 composed from torch ops, as torchao's bf16 optimizer does it (the baseline)."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32)
    bits = (x.view(torch.int32) + noise) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


def kernel_bench(*, size_mib: int = 256, repeat: int = 5) -> dict[str, float]:
    """K1/K2: fused export vs `x.to(torch.bfloat16)` on the same tensor, all cores, out of cache."""
    from weightsvc import rounding

    rounding.use_threads(os.cpu_count() or 1)
    x = torch.randn((size_mib << 20) // 4) * 0.02
    flat = x.numpy()
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    out_bytes = out.view(torch.uint8).numpy()
    residual = rounding.Residual()
    res_in = residual.tensor("w", x.numel())
    res_out = np.empty_like(res_in)

    def timed(fn: Callable[[], object]) -> float:
        fn()  # warm-up: compile, fault in

        def once() -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return _best(once, repeat)

    cast_s = timed(lambda: x.to(torch.bfloat16))
    spec_sr, spec_ef = rounding.ExportSpec("bf16", "sr"), rounding.ExportSpec("bf16", "ef")
    sr_s = timed(lambda: rounding.export_array(flat, out_bytes, spec_sr, version=1, name="w"))
    ef_s = timed(lambda: rounding.export_array(flat, out_bytes, spec_ef, version=1, name="w", residual=res_in,
                                               new_residual=res_out))
    torch_sr_s = timed(lambda: _torch_ops_sr(x))
    # The scaled formats' kernel (the generic one: fp8, mxfp8, nvfp4, mxfp4), sr, on a 4096-wide
    # matrix cut from the same tensor (at most 64 MiB: it is slower), its scales computed beforehand.
    grid = flat[: min(flat.size, 16 << 20) // 4096 * 4096].reshape(-1, 4096)
    scaled_gbps = {}
    for fmt in ("fp8_e4m3", *rounding.MICROSCALED):
        f = rounding.FORMATS[fmt]
        scales = rounding.fp8_scales(grid, f, "block")
        served = np.empty(f.nbytes(grid.size), np.uint8)
        spec = rounding.ExportSpec(fmt, "sr", fp8_pattern=".*")
        seconds = timed(functools.partial(rounding.export_array, grid.reshape(-1), served, spec, version=1, name="w",
                                          fmt=f, scales=scales))
        scaled_gbps[f"kernel_{fmt}_sr_gbps"] = round(grid.nbytes / seconds / 1e9, 2)
    return {
        **scaled_gbps,
        "K1": round(cast_s / sr_s, 3),
        "K2": round(cast_s / ef_s, 3),
        "K1_vs_torch_ops_sr": round(torch_sr_s / sr_s, 2),
        "kernel_cast_gbps": round(x.numel() * 4 / cast_s / 1e9, 2),
        "kernel_sr_gbps": round(x.numel() * 4 / sr_s / 1e9, 2),
        "kernel_ef_gbps": round(x.numel() * 4 / ef_s / 1e9, 2),
        "kernel_torch_ops_sr_gbps": round(x.numel() * 4 / torch_sr_s / 1e9, 2),
    }


def _timer(device: str, repeat: int) -> Callable[[Callable[[], object]], float]:
    """Best-of-`repeat` seconds of a GPU call, waiting for the device (a warm-up call first)."""

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()

        def once() -> float:
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start

        return _best(once, repeat)

    return timed


def cuda_kernel_bench(*, size_mib: float = 1024, repeat: int = 10, device: str = "cuda") -> dict[str, Any]:
    """K1/K2/K3 on a CUDA device: the Triton export kernels vs `x.to(torch.bfloat16)` on the GPU, plus
    `rounding.export` as the service calls it (for ef that includes the residual's trip to the host).
    (`device="cpu"` runs it under Triton's interpreter: to check the code path, not for figures.)"""
    from weightsvc import rounding
    from weightsvc.rounding import _triton

    x = torch.randn(int(size_mib * (1 << 20)) // 4, device=device) * 0.02
    out = torch.empty(x.numel(), dtype=torch.bfloat16, device=device).view(torch.int16)
    res_in, res_out = torch.zeros_like(x), torch.empty_like(x)
    spec_sr, spec_ef = rounding.ExportSpec("bf16", "sr"), rounding.ExportSpec("bf16", "ef")
    k0, k1 = spec_sr.key(1, "w")
    residual = rounding.Residual()
    timed = _timer(device, repeat)
    on = "cuda" if device == "cuda" else "auto"  # (the interpreter: rounding.export's CPU path)
    cast_s = timed(lambda: x.to(torch.bfloat16))
    sr_s = timed(lambda: _triton.bf16_export(x, out, k0, k1, 0, True, None, None))
    ef_s = timed(lambda: _triton.bf16_export(x, out, k0, k1, 0, spec_ef.stochastic, res_in, res_out))
    api_sr_s = timed(lambda: rounding.export(x, spec_sr, version=1, name="w", device=on))
    api_ef_s = timed(lambda: rounding.export(x, spec_ef, version=1, name="w", residual=residual, device=on))
    # fp8 with 128x128 blocks, scales computed on the GPU, as the service exports a weight
    grid = x.view(-1, 2048)
    spec_fp8 = rounding.ExportSpec("fp8_e4m3", "sr", scaling="block", fp8_pattern=".*")
    fp8_s = timed(lambda: rounding.export(grid, spec_fp8, version=1, name="w", device=on))
    # the microscaled formats the same way: block scales on the GPU, FP4 packed there
    micro_s = {}
    for fmt in rounding.MICROSCALED:
        spec = rounding.ExportSpec(fmt, "sr", fp8_pattern=".*")
        micro_s[fmt] = timed(functools.partial(rounding.export, grid, spec, version=1, name="w", device=on))
    gbps = {k: round(x.numel() * 4 / v / 1e9, 1) for k, v in
            {"cast": cast_s, "sr": sr_s, "ef": ef_s, "export_sr": api_sr_s, "export_ef": api_ef_s,
             "fp8_block_sr": fp8_s, **{f"{fmt}_sr": v for fmt, v in micro_s.items()}}.items()}
    return {
        "K1_cuda": round(cast_s / sr_s, 3),
        "K2_cuda": round(cast_s / ef_s, 3),
        "K3_cuda_fp8_block_sr": round(cast_s / fp8_s, 3),
        **{f"K3_cuda_{fmt}_sr": round(cast_s / v, 3) for fmt, v in micro_s.items()},
        "K1_cuda_export_api": round(cast_s / api_sr_s, 3),
        "K2_cuda_export_api": round(cast_s / api_ef_s, 3),
        **{f"kernel_cuda_{k}_gbps": v for k, v in gbps.items()},
        "device": torch.cuda.get_device_name() if device == "cuda" else "triton-interpreter",
    }


# Launches the profile tries: (elements per program, warps per program).
LAUNCHES = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16))


def cuda_kernel_profile(*, size_mib: float = 1024, repeat: int = 5, device: str = "cuda") -> dict[str, Any]:
    """Where the export kernels' time goes, for each launch in LAUNCHES: GB/s of fp32 for a plain cast,
    bf16 rtn (no hash), sr, sr without its counters (the cost of the reductions and atomics), ef,
    and fp8 sr with one tensor scale (the generic kernel). The fastest launch for sr is reported;
    the launch in use (`_triton.LAUNCH`) is put back afterwards."""
    from weightsvc.rounding import FORMATS, _cpu, _triton

    x = torch.randn(int(size_mib * (1 << 20)) // 4, device=device) * 0.02
    out16 = torch.empty(x.numel(), dtype=torch.int16, device=device)
    out8 = torch.empty(x.numel(), dtype=torch.uint8, device=device)
    res_in, res_out = torch.zeros_like(x), torch.empty_like(x)
    one = torch.ones(1, device=device)
    timed = _timer(device, repeat)
    calls: dict[str, Callable[[], object]] = {
        "rtn": lambda: _triton.bf16_export(x, out16, 1, 2, 0, False),
        "sr": lambda: _triton.bf16_export(x, out16, 1, 2, 0, True),
        "sr_uncounted": lambda: _triton.bf16_export(x, out16, 1, 2, 0, True, count=False),
        "ef": lambda: _triton.bf16_export(x, out16, 1, 2, 0, False, res_in, res_out),
        "fp8_sr": lambda: _triton.float_export(x, out8, 1, 2, 0, True, FORMATS["fp8_e4m3"], one, one,
                                               _cpu.SCALE_TENSOR, 1, 1),
    }
    nbytes = x.numel() * 4
    result: dict[str, Any] = {"profile_cast_gbps": round(nbytes / timed(lambda: x.to(torch.bfloat16)) / 1e9, 1)}
    in_use = dict(_triton.LAUNCH)
    best: tuple[float, str] = (0.0, "")
    try:
        for block, warps in LAUNCHES:
            _triton.LAUNCH.update(block=block, num_warps=warps)
            for what, call in calls.items():
                gbps = round(nbytes / timed(call) / 1e9, 1)
                result[f"profile_{block}x{warps}_{what}_gbps"] = gbps
                if what == "sr":
                    best = max(best, (gbps, f"{block}x{warps}"))
    finally:
        _triton.LAUNCH.update(in_use)
    result["profile_best_sr_launch"] = best[1]
    result["profile_launch_in_use"] = f"{in_use['block']}x{in_use['num_warps']}"
    return result


def device_push_bench(*, size_mib: int = 4096, repeat: int = 2, rounding: str = "sr",
                      small: int = 20_000) -> dict[str, Any]:
    """K3's service side: a push of a `size_mib` fp32 model to a server with `--device cuda` and to
    one with `--device cpu`, against raw TCP moving the same bytes (the network alone). Export
    hidden behind receipt: K3_push_cuda_vs_tcp near 1. Also the push of `small` tensors of 1024
    elements each (norms, biases: exported many to a launch), in µs per tensor."""
    model = _model(size_mib)
    nbytes = sum(t.numel() * 4 for t in model.values())
    many_model = {f"t.{i}": t for i, t in enumerate((torch.randn(small, 1024) * 0.02).unbind(0))}
    out: dict[str, Any] = {"K3_push_mib": size_mib, "K3_push_rounding": rounding}
    tcp = _best(lambda: raw_tcp_seconds(nbytes, download=False), repeat)
    out["K3_push_tcp_s"] = round(tcp, 3)
    for device in ("cuda", "cpu"):
        server = _ServerProcess(2, "--device", device, "--rounding", rounding)
        try:
            with LearnerClient(server.grpc) as learner:
                learner.push(0, model, "bench")  # warm: buffers mapped, kernels compiled
                seconds = []
                for step in range(1, 1 + repeat):
                    start = time.perf_counter()
                    learner.push(step, model, "bench")
                    seconds.append(time.perf_counter() - start)
                out[f"K3_push_{device}_s"] = round(min(seconds), 3)
                learner.push(0, many_model, "small")
                start = time.perf_counter()
                learner.push(1, many_model, "small")
                out[f"K3_small_push_{device}_us_per_tensor"] = round((time.perf_counter() - start) / small * 1e6, 1)
        finally:
            server.close()
    out["K3_push_cuda_vs_tcp"] = round(out["K3_push_tcp_s"] / out["K3_push_cuda_s"], 3)
    out["K3_push_cpu_vs_tcp"] = round(out["K3_push_tcp_s"] / out["K3_push_cpu_s"], 3)
    return out


def delta_bench(*, size_mib: int = 64, lr: float = 3e-6) -> dict[str, float]:
    """delta_ratio_<mode>: delta bytes / dense bytes between two versions one Adam-sized step apart
    (every element moves by lr, as in the demo), in mid-training: masters off the bf16 grid."""
    from weightsvc import rounding
    from weightsvc.protocol.delta import encode
    from weightsvc.protocol.manifest import Manifest, layout

    gen = torch.Generator().manual_seed(0)
    shape = ((size_mib << 20) // 4 // 2048, 2048)
    m0 = torch.randn(shape, generator=gen) * 0.02
    m1 = m0 + lr * torch.sign(torch.randn(shape, generator=gen))
    out: dict[str, float] = {}
    for mode in rounding.ROUNDINGS:
        spec, residual = rounding.ExportSpec("bf16", mode), rounding.Residual()
        served = [rounding.export_state_dict({"w": m}, spec, version=v, residual=residual)["w"]
                  for v, m in ((1, m0), (2, m1))]
        slots, nbytes = layout([("w", shape, "BF16")])
        manifest = Manifest("bench", 2, "bf16", mode, 0, 0.0, nbytes, "", tuple(slots))
        data = [t.view(torch.uint8).reshape(-1).numpy().data for t in served]
        out[f"delta_ratio_{mode}"] = round(len(encode(manifest, data[1], data[0])) / nbytes, 4)
    return out


# Which part of the bench measures each figure id (`--only` takes ids or part names).
PARTS = {"T1": "transfer", "T2": "transfer", "T3": "transfer", "M1": "transfer", "K1": "kernels", "K2": "kernels",
         "delta": "delta", "scale_3v1": "scale", "E1": "E1", "S1": "S1", "S2": "S2", "P1": "P1",
         "K3_sass": "sass"}
L1_TARGET_S = 0.1


def _row(what: str, value: str, target: str = "") -> dict[str, str]:
    return {"what": what, "value": value, "target": target}


def transfer_bench(model: dict[str, torch.Tensor], *, repeat: int, retain: int, tcp: RawTcp,
                   say: Callable[[str], Any]) -> dict[str, Any]:
    """T1, T2, T3 and M1 on one server."""
    master_bytes = sum(t.numel() * 4 for t in model.values())
    server = _ServerProcess(retain)
    try:
        learner = LearnerClient(server.grpc)
        step = [0]

        def push_once() -> float:
            step[0] += 1
            start = time.perf_counter()
            learner.push(step[0], model)
            return time.perf_counter() - start

        # Warm-up (kernel compile, allocator) until retention is full: a serving process lives in
        # that steady state, and the peak RSS is read in it.
        for _ in range(retain):
            push_once()
        warm = server.loop_lag()
        push_s = _best(push_once, repeat)
        served_bytes = InferenceClient(server.http).manifest().data_bytes
        say(f"push: {master_bytes / push_s / 1e9:.2f} GB/s")

        def pull_once(target: str) -> float:
            client = InferenceClient(target)
            start = time.perf_counter()
            manifest, data = client.pull_data()
            tensors_from_data(manifest, data)  # checksum verification is part of a pull
            elapsed = time.perf_counter() - start
            client.close()
            return elapsed

        pull_grpc_s = _best(lambda: pull_once(server.grpc), repeat)
        pull_http_s = _best(lambda: pull_once(server.http), repeat)
        say(f"pull: grpc {served_bytes / pull_grpc_s / 1e9:.2f} GB/s, http {served_bytes / pull_http_s / 1e9:.2f} GB/s")
        peak = server.peak_rss_bytes()  # M1: one learner and one puller at a time
        fanout_grpc_s = _best(lambda: fanout_pull_seconds(server.grpc, PULLERS), repeat)
        fanout_http_s = _best(lambda: fanout_pull_seconds(server.http, PULLERS), repeat)
        say(f"{PULLERS} pullers at once: grpc {PULLERS * served_bytes / fanout_grpc_s / 1e9:.2f} GB/s, "
            f"http {PULLERS * served_bytes / fanout_http_s / 1e9:.2f} GB/s")
        peak_fanout = server.peak_rss_bytes()  # with the gRPC streams of 8 pullers in flight too
        retained = sum(v.data_bytes for v in InferenceClient(server.http).versions())
        lag = server.loop_lag_max_s(warm)
        learner.close()
    finally:
        server.close()

    tcp_up_s, tcp_down_s = tcp.up(master_bytes), tcp.down(served_bytes)
    tcp_fanout_s = tcp.fanout(served_bytes, PULLERS)
    say(f"raw tcp: up {master_bytes / tcp_up_s / 1e9:.2f} GB/s, down {served_bytes / tcp_down_s / 1e9:.2f} GB/s")
    bound = 1.25 * retained + (300 << 20)
    t1_grpc, t1_http = tcp_down_s / pull_grpc_s, tcp_down_s / pull_http_s
    t3_grpc, t3_http = tcp_fanout_s / fanout_grpc_s, tcp_fanout_s / fanout_http_s
    t1, t2, t3, m1 = max(t1_grpc, t1_http), tcp_up_s / push_s, max(t3_grpc, t3_http), peak / bound
    return {
        "T1": round(t1, 3),
        "T1_grpc": round(t1_grpc, 3),
        "T1_http": round(t1_http, 3),
        "T2": round(t2, 3),
        "T3": round(t3, 3),
        "T3_grpc": round(t3_grpc, 3),
        "T3_http": round(t3_http, 3),
        "M1": round(m1, 3),
        "details": {
            "master_mib": master_bytes >> 20,
            "served_mib": served_bytes >> 20,
            "rounding": "sr",
            "format": "bf16",
            "push_gbps": round(master_bytes / push_s / 1e9, 3),
            "pull_grpc_gbps": round(served_bytes / pull_grpc_s / 1e9, 3),
            "pull_http_gbps": round(served_bytes / pull_http_s / 1e9, 3),
            "raw_tcp_up_gbps": round(master_bytes / tcp_up_s / 1e9, 3),
            "raw_tcp_down_gbps": round(served_bytes / tcp_down_s / 1e9, 3),
            "fanout_pullers": PULLERS,
            "fanout_grpc_gbps": round(PULLERS * served_bytes / fanout_grpc_s / 1e9, 3),
            "fanout_http_gbps": round(PULLERS * served_bytes / fanout_http_s / 1e9, 3),
            "raw_tcp_fanout_gbps": round(PULLERS * served_bytes / tcp_fanout_s / 1e9, 3),
            "peak_rss_mib": peak >> 20,
            "peak_rss_fanout_mib": peak_fanout >> 20,
            "m1_bound_mib": int(bound) >> 20,
            "retained_mib": retained >> 20,
            "loop_lag_max_s_transfer": lag,
        },
        "report": {
            "T1": _row("pull vs raw TCP (best of gRPC/HTTP)", f"{t1:.2f}x", ">= 0.5x"),
            "T1_grpc": _row("pull over gRPC vs raw TCP", f"{t1_grpc:.2f}x"),
            "T1_http": _row("pull over HTTP vs raw TCP", f"{t1_http:.2f}x"),
            "T2": _row("push fp32 -> committed vs raw TCP", f"{t2:.2f}x", ">= 0.4x"),
            "T3": _row(
                f"{PULLERS} pullers at once vs {PULLERS} raw TCP streams, aggregate (best of gRPC/HTTP)",
                f"{t3:.2f}x (grpc {t3_grpc:.2f}x, http {t3_http:.2f}x)",
                ">= 0.4x",
            ),
            "M1": _row(f"server peak RSS {peak >> 20} MiB / bound {int(bound) >> 20} MiB", f"{m1:.2f}", "<= 1.0"),
        },
    }


# One watching puller of E1, in its own process (argv: target, the version it holds already): pulls
# each new version as the watch announces it, verified, and prints when it holds it (the system-wide
# monotonic clock).
_WATCHER = """
import sys, time
from weightsvc.client import InferenceClient
client = InferenceClient(sys.argv[1])
for info in client.watch(after=int(sys.argv[2])):
    tensors = client.pull(version=info.version)
    print(info.version, time.monotonic(), flush=True)
    del tensors
"""


def sync_bench(model: dict[str, torch.Tensor], *, pullers: tuple[int, ...], repeat: int, tcp: RawTcp,
               say: Callable[[str], Any]) -> dict[str, Any]:
    """E1: from the learner's push call until `n` puller processes, already watching, hold the new
    version (checksums verified), over gRPC and over HTTP, vs raw TCP moving the masters up and then
    the served bytes down to `n` receivers at once."""
    master_bytes = sum(t.numel() * 4 for t in model.values())
    server = _ServerProcess(2)
    sync: dict[tuple[int, str], float] = {}
    commit: dict[tuple[int, str], float] = {}  # of the same run: the push call alone
    try:
        learner = LearnerClient(server.grpc)
        step = 1
        learner.push(step, model)  # warm-up: kernels compiled, buffers recycled from here on
        warm = server.loop_lag()

        def push_and_wait(procs: list[subprocess.Popen[str]]) -> tuple[float, float]:
            """Seconds from the push call until every watcher holds the version, and until committed."""
            nonlocal step
            step += 1
            start = time.monotonic()
            learner.push(step, model)
            pushed = time.monotonic()
            held = []
            for p in procs:
                assert p.stdout is not None
                version, at = p.stdout.readline().split()
                assert int(version) == step, (version, step)
                held.append(float(at))
            return max(held) - start, pushed - start

        served_bytes = InferenceClient(server.http).manifest().data_bytes
        for n in pullers:
            for transport, target in (("grpc", server.grpc), ("http", server.http)):
                procs = [subprocess.Popen([sys.executable, "-c", _WATCHER, target, str(step)], stdout=subprocess.PIPE,
                                          text=True) for _ in range(n)]
                try:
                    push_and_wait(procs)  # every watcher connected, watching and warm
                    runs = [push_and_wait(procs) for _ in range(repeat)]
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                sync[n, transport], commit[n, transport] = min(runs)
                say(f"E1: {n} {transport} puller(s) hold the version {sync[n, transport]:.2f} s after the push call "
                    f"(commit at {commit[n, transport]:.2f} s)")
        lag = server.loop_lag_max_s(warm)
        learner.close()
    finally:
        server.close()
    out: dict[str, Any] = {"details": {"loop_lag_max_s_E1": lag}, "report": {}}
    for n in pullers:
        bound = tcp.up(master_bytes) + tcp.fanout(served_bytes, n)
        ratios = {t: sync[n, t] / bound for t in ("grpc", "http")}
        best = min(ratios.values())
        out[f"E1_{n}"] = round(best, 3)
        for t, r in ratios.items():
            out[f"E1_{n}_{t}"] = round(r, 3)
            out["details"][f"e1_{n}_{t}_sync_s"] = round(sync[n, t], 3)
            out["details"][f"e1_{n}_{t}_commit_s"] = round(commit[n, t], 3)
        out["details"][f"e1_{n}_raw_tcp_bound_s"] = round(bound, 3)
        out["report"][f"E1_{n}"] = _row(
            f"push call -> {n} watching puller(s) hold it, vs raw TCP up + down ({bound:.2f} s)",
            f"{best:.2f}x (grpc {sync[n, 'grpc']:.2f} s, http {sync[n, 'http']:.2f} s)",
            "<= 1.5x" if n == 1 else "<= 2.0x",
        )
    out["details"]["e1_master_mib"] = master_bytes >> 20
    return out


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def tensor_cost_bench(*, total_mib: int, counts: tuple[int, ...], repeat: int,
                      say: Callable[[str], Any]) -> dict[str, Any]:
    """S1: push + pull (checksums verified) of `total_mib` fp32 split into each of `counts` tensors;
    the least-squares slope of the time on the count is the cost of one tensor, end to end."""
    gen = torch.Generator().manual_seed(0)
    elements = (total_mib << 20) // 4
    times: dict[str, list[float]] = {"push": [], "pull_grpc": [], "pull_http": []}
    server = _ServerProcess(2)
    try:
        learner = LearnerClient(server.grpc)
        clients = {"grpc": InferenceClient(server.grpc), "http": InferenceClient(server.http)}
        step = 1
        learner.push(step, {"w": torch.zeros(1 << 16)})  # warm-up: kernels compiled
        warm = server.loop_lag()
        for count in counts:
            # Views of one block at distinct offsets: distinct tensors to the learner, built at once.
            model = {f"t.{i}": t for i, t in enumerate((torch.randn(count, elements // count, generator=gen) * 0.02)
                                                       .unbind(0))}

            def push_once(model: dict[str, torch.Tensor]) -> float:
                nonlocal step
                step += 1
                start = time.perf_counter()
                learner.push(step, model)
                return time.perf_counter() - start

            def pull_once(client: InferenceClient) -> float:
                start = time.perf_counter()
                client.pull(version=step)
                return time.perf_counter() - start

            times["push"].append(_best(lambda m=model: push_once(m), repeat))  # type: ignore[misc]
            for t, client in clients.items():
                times[f"pull_{t}"].append(_best(lambda c=client: pull_once(c), repeat))  # type: ignore[misc]
            say(f"S1: {count} tensors: push {times['push'][-1]:.2f} s, pull grpc {times['pull_grpc'][-1]:.2f} s, "
                f"http {times['pull_http'][-1]:.2f} s")
        lag = server.loop_lag_max_s(warm)
        for client in clients.values():
            client.close()
        learner.close()
    finally:
        server.close()
    xs = [float(c) for c in counts]
    us = {k: _slope(xs, v) * 1e6 for k, v in times.items()}
    s1 = {t: us["push"] + us[f"pull_{t}"] for t in ("grpc", "http")}
    best = min(s1.values())
    return {
        "S1": round(best, 2),
        "S1_grpc": round(s1["grpc"], 2),
        "S1_http": round(s1["http"], 2),
        "details": {
            "s1_total_mib": total_mib,
            "s1_tensors": list(counts),
            **{f"s1_{k}_s": [round(x, 4) for x in v] for k, v in times.items()},
            **{f"s1_{k}_us_per_tensor": round(v, 2) for k, v in us.items()},
            "loop_lag_max_s_S1": lag,
        },
        "report": {
            "S1": _row(
                f"push + pull per tensor, {total_mib} MiB in {'/'.join(map(str, counts))} tensors (slope)",
                f"{best:.1f} us (push {us['push']:.1f}, pull grpc {us['pull_grpc']:.1f}, http {us['pull_http']:.1f})",
                "<= 50 us",
            ),
        },
    }


def _push_steps(learner: LearnerClient, model: dict[str, torch.Tensor], first: int, last: int) -> None:
    for step in range(first, last + 1):
        learner.push(step, model)


def _peak_anon_rss(server: _ServerProcess, work: Callable[[], object]) -> int:
    """The server's peak anonymous RSS while `work` runs, sampled every 50 ms (there is no HWM of it)."""
    samples = [server.anon_rss_bytes()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            samples.append(server.anon_rss_bytes())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(samples)


def data_dir_rss_bench(model: dict[str, torch.Tensor], *, retains: tuple[int, ...],
                       say: Callable[[str], Any]) -> dict[str, Any]:
    """S2: with --data-dir, the server's anonymous RSS once the same pushes are done, for each
    --retain; the least-squares slope of it on the retained bytes (0: the versions live in the page
    cache of their files, not in the process)."""
    import tempfile

    pushes = max(retains) + 1  # the same pushes for every --retain: each fills its retention and evicts
    anon: dict[int, int] = {}
    peak: dict[int, int] = {}
    retained: dict[int, int] = {}
    lags = []
    for k in retains:
        with tempfile.TemporaryDirectory(prefix="weightsvc-bench-") as data_dir:
            server = _ServerProcess(k, "--data-dir", data_dir)
            try:
                with LearnerClient(server.grpc) as learner:
                    learner.push(1, model)  # warm-up: kernels compiled
                    warm = server.loop_lag()
                    peak[k] = _peak_anon_rss(server, functools.partial(_push_steps, learner, model, 2, pushes))
                time.sleep(0.5)  # what a push left behind to free, freed
                anon[k] = server.anon_rss_bytes()
                peak[k] = max(peak[k], anon[k])  # (the peak is sampled: the last reading counts too)
                retained[k] = sum(v.data_bytes for v in InferenceClient(server.http).versions())
                lags.append(server.loop_lag_max_s(warm))
            finally:
                server.close()
        say(f"S2: --retain {k}: anonymous RSS {anon[k] >> 20} MiB (peak {peak[k] >> 20}) "
            f"holding {retained[k] >> 20} MiB")
    xs = [float(retained[k]) for k in retains]
    s2 = _slope(xs, [float(anon[k]) for k in retains]) if len(set(xs)) > 1 else 0.0
    return {
        "S2": round(s2, 3),
        "details": {
            **{f"s2_retain_{k}_anon_rss_mib": anon[k] >> 20 for k in retains},
            **{f"s2_retain_{k}_peak_anon_rss_mib": peak[k] >> 20 for k in retains},
            **{f"s2_retain_{k}_retained_mib": retained[k] >> 20 for k in retains},
            "s2_pushes": pushes,
            "loop_lag_max_s_S2": max(lags),
        },
        "report": {
            "S2": _row(
                "anonymous RSS per retained byte, --data-dir, --retain " + "/".join(map(str, retains)),
                f"{s2:.3f} (" + ", ".join(f"{anon[k] >> 20} MiB" for k in retains) + ")",
                "~0: independent of --retain",
            ),
        },
    }


def _plain_http_seconds(url: str, path: str, nbytes: int, buf: memoryview | None = None) -> float:
    """Seconds to read one HTTP body of `nbytes` with http.client, no parsing, into `buf` (preallocated)
    or, without one, into a fresh buffer mapped within the clock, as a pull's."""
    import http.client

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port)
    try:
        start = time.perf_counter()
        buf = alloc(nbytes) if buf is None else buf
        conn.request("GET", path)
        resp = conn.getresponse()
        got = 0
        while n := resp.readinto(buf[got : got + _RECV_PIECE]):
            got += n
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
    if resp.status != 200 or got != len(buf):
        raise RuntimeError(f"GET {url}{path}: status {resp.status}, {got} of {len(buf)} bytes")
    return elapsed


_NGINX_CONF = """
daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 64; }}
http {{
    sendfile on;
    access_log off;
    client_body_temp_path {d}/tmp;
    proxy_temp_path {d}/tmp;
    fastcgi_temp_path {d}/tmp;
    uwsgi_temp_path {d}/tmp;
    scgi_temp_path {d}/tmp;
    server {{
        listen 127.0.0.1:{port};
        root {d}/root;
    }}
}}
"""


class _Nginx:
    """A private nginx serving `root` on a free port, in the foreground, every file of it in `d`."""

    def __init__(self, d: str) -> None:
        import shutil

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with open(f"{d}/nginx.conf", "w") as f:
            f.write(_NGINX_CONF.format(d=d, port=port))
        exe = shutil.which("nginx")
        assert exe is not None
        self.proc = subprocess.Popen([exe, "-p", d, "-e", f"{d}/error.log", "-c", f"{d}/nginx.conf"],
                                     stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    error = Path(d, "error.log").read_text()[-500:]
                    raise RuntimeError(f"nginx did not start: {error}") from None
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def pull_bench(model: dict[str, torch.Tensor], *, repeat: int, tcp: RawTcp,
               say: Callable[[str], Any]) -> dict[str, Any]:
    """P1: `InferenceClient.pull` (into memory, checksums verified) over HTTP and gRPC vs raw TCP into
    a preallocated buffer; what the transfer alone costs (`pull_data`, no verification); and a plain
    http.client read into a preallocated buffer, and into a fresh one as a pull's (mapping it is part
    of the pull). For reference, the same served file from nginx (sendfile on) to the same HTTP client
    and the same plain read."""
    import shutil
    import tempfile

    def timed(fn: Callable[[], object]) -> float:
        def once() -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return _best(once, repeat)

    seconds: dict[str, float] = {}
    nginx_skipped = None
    with tempfile.TemporaryDirectory(prefix="weightsvc-bench-") as d:
        server = _ServerProcess(2)
        try:
            with LearnerClient(server.grpc) as learner:
                version = learner.push(1, model).version
            warm = server.loop_lag()
            for t, target in (("grpc", server.grpc), ("http", server.http)):
                with InferenceClient(target) as client:
                    client.manifest()  # connected before the clock starts
                    seconds[f"pull_{t}"] = timed(lambda c=client: c.pull(version=version))  # type: ignore[misc]
                    seconds[f"pull_data_{t}"] = timed(lambda c=client: c.pull_data(version=version))  # type: ignore[misc]
            # The nginx root holds the file at the service's own path: the same client pulls from both.
            path = f"/v1/models/default/versions/{version}/safetensors"
            os.makedirs(f"{d}/root{os.path.dirname(path)}")
            os.makedirs(f"{d}/tmp")
            with InferenceClient(server.http) as client:
                served_bytes = client.pull_file(f"{d}/root{path}", version=version).data_bytes
            file_bytes = os.path.getsize(f"{d}/root{path}")
            buf = alloc(file_bytes)
            seconds["plain_http"] = _best(lambda: _plain_http_seconds(server.http, path, file_bytes, buf), repeat)
            seconds["plain_http_fresh"] = _best(lambda: _plain_http_seconds(server.http, path, file_bytes), repeat)
            lag = server.loop_lag_max_s(warm)
        finally:
            server.close()
        if shutil.which("nginx") is None:
            nginx_skipped = "nginx is not on PATH"
        else:
            for sub in ("", "/root", "/root/v1", "/root/v1/models"):  # nginx's workers may run as nobody
                os.chmod(f"{d}{sub}", 0o755)
            nginx = _Nginx(d)
            try:
                with InferenceClient(nginx.url) as client:
                    seconds["pull_nginx"] = timed(lambda c=client: c.pull(version=version))  # type: ignore[misc]
                seconds["plain_nginx"] = _best(lambda: _plain_http_seconds(nginx.url, path, file_bytes, buf), repeat)
            finally:
                nginx.close()
    down = tcp.down(served_bytes)
    ratio = {k: down / v for k, v in seconds.items()}
    say("P1: " + ", ".join(f"{k} {served_bytes / v / 1e9:.2f} GB/s" for k, v in seconds.items())
        + f"; raw tcp {served_bytes / down / 1e9:.2f} GB/s")
    out: dict[str, Any] = {
        "P1_http": round(ratio["pull_http"], 3),
        "P1_grpc": round(ratio["pull_grpc"], 3),
        "P1_nginx": None if nginx_skipped else round(ratio["pull_nginx"], 3),
        "details": {
            "p1_served_mib": served_bytes >> 20,
            "p1_raw_tcp_down_gbps": round(served_bytes / down / 1e9, 3),
            **{
                f"p1_{k}_gbps": round((file_bytes if k.startswith("plain") else served_bytes) / v / 1e9, 3)
                for k, v in seconds.items()
            },
            **{f"p1_{k}_vs_raw_tcp": round(v, 3) for k, v in ratio.items()},
            "p1_nginx_skipped": nginx_skipped,
            "loop_lag_max_s_P1": lag,
        },
        "report": {
            "P1_http": _row(
                "InferenceClient.pull over HTTP (verified) vs raw TCP into a preallocated buffer",
                f"{ratio['pull_http']:.2f}x (transfer alone {ratio['pull_data_http']:.2f}x)",
                ">= 0.8x",
            ),
            "P1_grpc": _row(
                "InferenceClient.pull over gRPC (verified) vs raw TCP into a preallocated buffer",
                f"{ratio['pull_grpc']:.2f}x (transfer alone {ratio['pull_data_grpc']:.2f}x)",
                ">= 0.6x",
            ),
            "P1_nginx": _row(
                "the same HTTP client pulling the same file from nginx (sendfile) vs raw TCP",
                f"skipped: {nginx_skipped}"
                if nginx_skipped
                else f"{ratio['pull_nginx']:.2f}x (plain read: nginx {ratio['plain_nginx']:.2f}x, "
                f"weightsvc {ratio['plain_http']:.2f}x, fresh buffer {ratio['plain_http_fresh']:.2f}x)",
                "reference",
            ),
        },
    }
    return out


# How a launch specializes the kernels' arguments: pointer types, and which are 16-aligned (the CUDA
# caching allocator's blocks, and sizes that are multiples of 16).
_ARG_TYPES = {"src": "*fp32", "residual": "*fp32", "new_residual": "*fp32", "inv_scales": "*fp32", "scales": "*fp32",
              "counts": "*i64", "blocks": "*i64", "keys": "*i64", "n": "i32"}
_ALIGNED = ("src", "dst", "residual", "new_residual", "n")


def compile_kernel(kernel: Any, constexprs: dict[str, object], served: str, arch: int = 90) -> Any:
    """A Triton kernel compiled ahead of time for CUDA compute capability `arch` (90: H100/H200),
    as a launch specializes it, down to the cubin: no GPU needed, only Triton's compiler (not under
    its interpreter). `served`: the dst pointer's type ("*i16", "*u8")."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from weightsvc.rounding import _triton

    names = kernel.arg_names
    types = _ARG_TYPES | {"dst": served}
    signature = {a: "constexpr" if a in constexprs else types.get(a, "i64") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in _ALIGNED if a in names}
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                   options=_triton.launch_options())


def _sass_instructions(cubin: bytes) -> int:
    """Machine instructions in a cubin (NOPs left out), disassembled by the nvdisasm Triton ships."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in text.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line) and "NOP" not in line)


def sass_bench() -> dict[str, Any]:
    """`kernel_instructions`, in a process of its own where Triton's interpreter is on (its kernels
    cannot be compiled); None where Triton or its compiler cannot be had."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from weightsvc.cli import bench; print(json.dumps(bench.kernel_instructions()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"K3_sass": None, "details": {"k3_sass_skipped": why}}
    figures = json.loads(done.stdout)
    ratios = ", ".join(f"{k} {figures[f'K3_sass_{k}_vs_cast']:.1f}x"
                       for k in ("bf16_sr", "bf16_ef", "fp8_block_pow2_sr", "nvfp4_sr"))
    what = f"GPU kernels' machine instructions per element vs a cast ({figures['K3_sass_arch']})"
    return {"K3_sass": figures["K3_sass_bf16_sr_vs_cast"], "details": figures,
            "report": {"K3_sass": _row(what, ratios)}}


def kernel_instructions(arch: int = 90) -> dict[str, Any]:
    """K3 measured without a GPU: the machine instructions per element of each export kernel, as
    compiled for `arch`, against a plain fp32 -> bf16 cast kernel compiled the same way. Every
    kernel here is straight-line code over the elements of one program, so instructions / elements
    per thread is what an element costs to issue; a kernel far above the cast is bound by its
    instructions, not by memory (the H200's measured K1 0.45). Must run outside the interpreter."""
    import triton
    import triton.language as tl

    from weightsvc.rounding import FORMATS, _triton
    from weightsvc.rounding._formats import SCALE_BLOCK, SCALE_ROW

    @triton.jit
    def cast_kernel(src, dst, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n).to(tl.bfloat16), mask=i < n)

    per_thread = _triton.LAUNCH["block"] / (_triton.LAUNCH["num_warps"] * 32)
    bf16 = {"rtn": (False, False, True), "sr": (True, False, True), "sr_uncounted": (True, False, False),
            "ef": (False, True, True)}
    cases: dict[str, tuple[Any, dict[str, object], str]] = {
        "cast": (cast_kernel, {"BLOCK": _triton.LAUNCH["block"]}, "*bf16"),
        **{f"bf16_{k}": (_triton._bf16_kernel, _triton.bf16_constexprs(*v), "*i16") for k, v in bf16.items()},
    }
    scaled = (("fp8_block_pow2", "fp8_e4m3", SCALE_BLOCK, 4096), ("fp8_block", "fp8_e4m3", SCALE_BLOCK, 4000),
              ("mxfp8", "mxfp8", SCALE_ROW, 32), ("nvfp4", "nvfp4", SCALE_ROW, 16), ("mxfp4", "mxfp4", SCALE_ROW, 32))
    for label, name, mode, cols in scaled:  # (rows of 4096: shifts; of 4000: divisions)
        for rnd in ("sr", "ef"):
            constexprs = _triton.float_constexprs(FORMATS[name], mode, rnd == "sr", rnd == "ef", cols)
            cases[f"{label}_{rnd}"] = (_triton._float_kernel, constexprs, "*u8")
    per_element = {k: _sass_instructions(compile_kernel(*v, arch).asm["cubin"]) / per_thread for k, v in cases.items()}
    cast = per_element.pop("cast")
    return {
        "K3_sass_cast_per_element": round(cast, 1),
        **{f"K3_sass_{k}_per_element": round(v, 1) for k, v in per_element.items()},
        **{f"K3_sass_{k}_vs_cast": round(v / cast, 1) for k, v in per_element.items()},
        "K3_sass_arch": f"sm_{arch}",
        "K3_sass_launch": f"{_triton.LAUNCH['block']}x{_triton.LAUNCH['num_warps']}",
    }


def run_bench(
    *,
    size_mib: int = 1024,
    repeat: int = 3,
    retain: int = 4,
    only: set[str] | None = None,
    pullers: tuple[int, ...] = (1, 8),
    s1_mib: int = 64,
    s1_tensors: tuple[int, ...] = (100, 10_000, 100_000),
    s2_retains: tuple[int, ...] = (1, 2, 4),
    log: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """The figures of `only` (ids or part names of PARTS; all when None), as one JSON-able dict:
    figure ids at the top, the numbers behind them in "details", one row per figure in "report"."""
    say = log or (lambda _m: None)
    parts = set(PARTS.values()) if only is None else {PARTS.get(x, x) for x in only}
    model: dict[str, torch.Tensor] = {}
    if parts & {"transfer", "E1", "P1", "S2"}:
        model = _model(size_mib)
        say(f"model: {len(model)} tensors, {sum(t.numel() * 4 for t in model.values()) / 2**20:.0f} MiB fp32")
    tcp = RawTcp(repeat)
    result: dict[str, Any] = {"details": {"cpus": os.cpu_count()}, "report": {}}

    def add(name: str, started: float, part: dict[str, Any]) -> None:
        result["details"].update(part.pop("details", {}))
        result["details"][f"seconds_{name}"] = round(time.monotonic() - started, 1)  # what a run costs
        result["report"].update(part.pop("report", {}))
        result.update(part)

    if "transfer" in parts:
        add("transfer", time.monotonic(), transfer_bench(model, repeat=repeat, retain=retain, tcp=tcp, say=say))
    # E1 and S1: best of 3 and 2 at most; each run of 8 pullers, and of 100,000 tensors, takes seconds.
    if "E1" in parts:
        add("E1", time.monotonic(), sync_bench(model, pullers=pullers, repeat=min(repeat, 3), tcp=tcp, say=say))
    if "P1" in parts:
        add("P1", time.monotonic(), pull_bench(model, repeat=repeat, tcp=tcp, say=say))
    if "S1" in parts:
        add("S1", time.monotonic(),
            tensor_cost_bench(total_mib=s1_mib, counts=s1_tensors, repeat=min(repeat, 2), say=say))
    if "S2" in parts:
        add("S2", time.monotonic(), data_dir_rss_bench(model, retains=s2_retains, say=say))
    if "kernels" in parts:
        say("kernels: K1/K2 on a 256 MiB fp32 tensor")
        started = time.monotonic()
        kernels = kernel_bench(repeat=repeat)
        add("kernels", started, {k: v for k, v in kernels.items() if not k.startswith("kernel_")})
        result["details"].update({k: v for k, v in kernels.items() if k.startswith("kernel_")})
        result["report"].update({
            "K1": _row("fused sr bf16 export vs x.to(bfloat16)", f"{kernels['K1']:.2f}x", ">= 0.8x"),
            "K2": _row("fused ef bf16 export vs x.to(bfloat16)", f"{kernels['K2']:.2f}x", ">= 0.4x"),
            "K1_vs_torch_ops_sr": _row("fused sr vs sr composed from torch ops",
                                       f"{kernels['K1_vs_torch_ops_sr']:.1f}x faster"),
        })
    if "delta" in parts:
        add("delta", time.monotonic(), delta_bench())
    if "sass" in parts:
        say("K3_sass: the GPU kernels compiled for sm_90, their instructions counted")
        add("sass", time.monotonic(), sass_bench())
    if "scale" in parts:
        started = time.monotonic()
        scale = scale_bench(size_mib=min(size_mib, 512), repeat=repeat, log=say)
        add("scale", started, {"scale_3v1": scale["scale_3v1"], "details": scale.get("details", {})})
        result["report"]["scale_3v1"] = _row(
            f"{PULLERS} pullers from 3 sharded replicas vs from 1, aggregate",
            "no Redis" if result["scale_3v1"] is None else f"{result['scale_3v1']:.2f}x",
            f"cores here: {os.cpu_count()}",
        )
    lags = [v for k, v in result["details"].items() if k.startswith("loop_lag_max_s_")]
    if lags:  # L1: the longest block of the event loop, over every server of this run after its first push
        result["L1"] = max(lags)
        result["report"]["L1"] = _row("event loop blocked at most (bucket), every server after its first push",
                                      f"<= {max(lags) * 1000:.0f} ms", f"<= {L1_TARGET_S * 1000:.0f} ms")
    return result


def _scrape(http: str) -> dict[str, float]:
    """The service's own gauges, summed over labels: what a leak would show in."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        f.name: sum(s.value for s in f.samples)
        for f in text_string_to_metric_families(text)
        if f.name in ("weightsvc_staged_bytes", "weightsvc_pulls_in_flight", "weightsvc_pushes_in_flight",
                      "weightsvc_retained_versions")
    }


def soak(
    seconds: float,
    *,
    size_mib: int = 64,
    pullers: int = PULLERS,
    retain: int = 4,
    log: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """One learner pushing continuously and `pullers` pulling (half gRPC, half HTTP) for `seconds`.

    After warm-up (retention full, and a fifth of the time), the server's RSS must stay within 10%
    of where warm-up left it; at the end nothing may be left staged or in flight and exactly
    `retain` versions retained."""
    say = log or (lambda _m: None)
    model = _model(size_mib)
    server = _ServerProcess(retain)
    stop = threading.Event()
    pushed, pulled, failures = [0], [0], []

    def learn() -> None:
        with LearnerClient(server.grpc) as learner:
            step = 0
            while step == 0 or not stop.is_set():  # the first version before the pullers start
                step += 1
                learner.push(step, {name: t + 1e-4 * step for name, t in model.items()})
                pushed[0] = step
                first.set()

    def pull(i: int) -> None:
        with InferenceClient(server.http if i % 2 else server.grpc) as client:
            while not stop.is_set():
                tensors_from_data(*client.pull_data())
                pulled[0] += 1

    def run(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # reported, and the soak fails
            failures.append(f"{fn.__name__}: {e}")
            stop.set()

    threads = [threading.Thread(target=run, args=(learn,))]
    threads += [threading.Thread(target=run, args=(pull, i)) for i in range(pullers)]
    samples: list[tuple[float, int]] = []  # (seconds since start, server RSS)
    start = time.monotonic()
    first = threading.Event()
    try:
        threads[0].start()
        first.wait(120)
        for t in threads[1:]:
            t.start()
        warm_until = None
        while not stop.is_set() and time.monotonic() - start < seconds:
            now = time.monotonic() - start
            samples.append((now, server.rss_bytes()))
            if warm_until is None and pushed[0] >= retain + 1 and now >= seconds / 5:
                warm_until = now
            stop.wait(0.5)
        stop.set()
        for t in threads:
            t.join(120)
        gauges = _scrape(server.http)
    finally:
        server.close()
    warm_until = warm_until if warm_until is not None else seconds
    warm = [rss for at, rss in samples if at <= warm_until][-4:] or [samples[0][1]]
    after = [rss for at, rss in samples if at > warm_until] or warm
    baseline = max(warm)
    growth = max(after) / baseline - 1
    result = {
        "soak_seconds": round(time.monotonic() - start, 1),
        "versions_pushed": pushed[0],
        "pulls": pulled[0],
        "pullers": pullers,
        "rss_warm_mib": baseline >> 20,
        "rss_max_after_warm_mib": max(after) >> 20,
        "rss_end_mib": samples[-1][1] >> 20,
        "rss_growth": round(growth, 3),
        "retained_versions": int(gauges.get("weightsvc_retained_versions", -1)),
        "staged_bytes": int(gauges.get("weightsvc_staged_bytes", -1)),
        "pulls_in_flight": int(gauges.get("weightsvc_pulls_in_flight", -1)),
        "pushes_in_flight": int(gauges.get("weightsvc_pushes_in_flight", -1)),
        "failures": failures,
    }
    result["ok"] = (
        not failures
        and growth <= 0.10
        and result["retained_versions"] == retain
        and result["staged_bytes"] == result["pulls_in_flight"] == result["pushes_in_flight"] == 0
    )
    say(f"soak: {result}")
    return result
