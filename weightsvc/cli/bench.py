"""`weightsvc bench`: the performance figures as ratios against a baseline measured in the same run.

Transfer part (this module): the service runs as a separate process, as it does in production.
- T2: push an fp32 model until committed (export included) vs raw TCP loopback on the same bytes.
- T1: pull the committed version (gRPC and HTTP, checksums verified) vs raw TCP on the served bytes.
- T3: 8 puller processes at once, aggregate, vs 8 raw TCP streams from one process at once.
- M1: the server's peak RSS against 1.25 x retained bytes + 300 MiB.
- scale_3v1: 8 pullers at once from 3 sharded replicas (on Redis) vs from 1 replica, aggregate.
Raw TCP is two Python processes moving a preallocated buffer with sendall/recv_into: the best a
Python peer can do on this machine, so a ratio of 1.0 means "as fast as the socket".
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from weightsvc.client import InferenceClient, LearnerClient, tensors_from_data
from weightsvc.core.memory import alloc

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
                              text=True) for _ in range(pullers)]  # fmt: skip
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
    n = max(1, size_mib // TENSOR_MIB)
    side = int((TENSOR_MIB << 20) // 4) // 2048
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
                log: Callable[[str], Any] | None = None) -> dict[str, Any]:  # fmt: skip
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
                   for i in range(count)]  # fmt: skip
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
                                               new_residual=res_out))  # fmt: skip
    torch_sr_s = timed(lambda: _torch_ops_sr(x))
    return {
        "K1": round(cast_s / sr_s, 3),
        "K2": round(cast_s / ef_s, 3),
        "K1_vs_torch_ops_sr": round(torch_sr_s / sr_s, 2),
        "kernel_cast_gbps": round(x.numel() * 4 / cast_s / 1e9, 2),
        "kernel_sr_gbps": round(x.numel() * 4 / sr_s / 1e9, 2),
        "kernel_ef_gbps": round(x.numel() * 4 / ef_s / 1e9, 2),
        "kernel_torch_ops_sr_gbps": round(x.numel() * 4 / torch_sr_s / 1e9, 2),
    }


def cuda_kernel_bench(*, size_mib: int = 1024, repeat: int = 10) -> dict[str, float]:
    """K1/K2 on a CUDA device: the Triton export kernels vs `x.to(torch.bfloat16)` on the GPU, plus
    `rounding.export` as the service calls it (for ef that includes the residual's trip to the host)."""
    from weightsvc import rounding
    from weightsvc.rounding import _triton

    x = torch.randn((size_mib << 20) // 4, device="cuda") * 0.02
    out = torch.empty(x.numel(), dtype=torch.bfloat16, device="cuda").view(torch.int16)
    res_in, res_out = torch.zeros_like(x), torch.empty_like(x)
    spec_sr, spec_ef = rounding.ExportSpec("bf16", "sr"), rounding.ExportSpec("bf16", "ef")
    k0, k1 = spec_sr.key(1, "w")
    residual = rounding.Residual()

    def timed(fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()

        def once() -> float:
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - start

        return _best(once, repeat)

    cast_s = timed(lambda: x.to(torch.bfloat16))
    sr_s = timed(lambda: _triton.bf16_export(x, out, k0, k1, 0, True, None, None))
    ef_s = timed(lambda: _triton.bf16_export(x, out, k0, k1, 0, spec_ef.stochastic, res_in, res_out))
    api_sr_s = timed(lambda: rounding.export(x, spec_sr, version=1, name="w"))
    api_ef_s = timed(lambda: rounding.export(x, spec_ef, version=1, name="w", residual=residual))
    gbps = {k: round(x.numel() * 4 / v / 1e9, 1) for k, v in
            {"cast": cast_s, "sr": sr_s, "ef": ef_s, "export_sr": api_sr_s, "export_ef": api_ef_s}.items()}  # fmt: skip
    return {
        "K1_cuda": round(cast_s / sr_s, 3),
        "K2_cuda": round(cast_s / ef_s, 3),
        "K1_cuda_export_api": round(cast_s / api_sr_s, 3),
        "K2_cuda_export_api": round(cast_s / api_ef_s, 3),
        **{f"kernel_cuda_{k}_gbps": v for k, v in gbps.items()},
        "device": torch.cuda.get_device_name(),  # type: ignore[dict-item]
    }


def delta_bench(*, size_mib: int = 64, lr: float = 3e-6) -> dict[str, float]:
    """delta_ratio_<mode>: delta bytes / dense bytes between two versions one Adam-sized step apart
    (every element moves by lr, as in the demo), in mid-training: masters off the bf16 grid."""
    from weightsvc import rounding
    from weightsvc.core.delta import encode
    from weightsvc.core.manifest import Manifest, layout

    gen = torch.Generator().manual_seed(0)
    shape = ((size_mib << 20) // 4 // 2048, 2048)
    m0 = torch.randn(shape, generator=gen) * 0.02
    m1 = m0 + lr * torch.sign(torch.randn(shape, generator=gen))
    out: dict[str, float] = {}
    for mode in rounding.ROUNDINGS:
        spec, residual = rounding.ExportSpec("bf16", mode), rounding.Residual()
        served = [rounding.export_state_dict({"w": m}, spec, version=v, residual=residual)["w"]
                  for v, m in ((1, m0), (2, m1))]  # fmt: skip
        slots, nbytes = layout([("w", shape, "BF16")])
        manifest = Manifest("bench", 2, "bf16", mode, 0, 0.0, nbytes, "", tuple(slots))
        data = [t.view(torch.uint8).reshape(-1).numpy().data for t in served]
        out[f"delta_ratio_{mode}"] = round(len(encode(manifest, data[1], data[0])) / nbytes, 4)
    return out


def run_bench(
    *, size_mib: int = 1024, repeat: int = 3, retain: int = 4, log: Callable[[str], Any] | None = None
) -> dict[str, Any]:
    say = log or (lambda _m: None)
    model = _model(size_mib)
    master_bytes = sum(t.numel() * 4 for t in model.values())
    say(f"model: {len(model)} tensors, {master_bytes / 2**20:.0f} MiB fp32")
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
            f"http {PULLERS * served_bytes / fanout_http_s / 1e9:.2f} GB/s")  # fmt: skip
        peak_fanout = server.peak_rss_bytes()  # with the gRPC streams of 8 pullers in flight too
        retained = sum(v.data_bytes for v in InferenceClient(server.http).versions())
        learner.close()
    finally:
        server.close()

    tcp_up_s = _best(lambda: raw_tcp_seconds(master_bytes, download=False), repeat)
    tcp_down_s = _best(lambda: raw_tcp_seconds(served_bytes, download=True), repeat)
    tcp_fanout_s = _best(lambda: raw_tcp_fanout_seconds(served_bytes, PULLERS), repeat)
    say(f"raw tcp: up {master_bytes / tcp_up_s / 1e9:.2f} GB/s, down {served_bytes / tcp_down_s / 1e9:.2f} GB/s")
    bound = 1.25 * retained + (300 << 20)
    t1_grpc, t1_http = tcp_down_s / pull_grpc_s, tcp_down_s / pull_http_s
    t3_grpc, t3_http = tcp_fanout_s / fanout_grpc_s, tcp_fanout_s / fanout_http_s
    result: dict[str, Any] = {
        "T1": round(max(t1_grpc, t1_http), 3),
        "T1_grpc": round(t1_grpc, 3),
        "T1_http": round(t1_http, 3),
        "T2": round(tcp_up_s / push_s, 3),
        "T3": round(max(t3_grpc, t3_http), 3),
        "T3_grpc": round(t3_grpc, 3),
        "T3_http": round(t3_http, 3),
        "M1": round(peak / bound, 3),
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
            "cpus": os.cpu_count(),
        },
    }
    say("kernels: K1/K2 on a 256 MiB fp32 tensor")
    kernels = kernel_bench(repeat=repeat)
    result.update({k: v for k, v in kernels.items() if not k.startswith("kernel_")})
    result.update(delta_bench())
    result["details"].update({k: v for k, v in kernels.items() if k.startswith("kernel_")})
    scale = scale_bench(size_mib=min(size_mib, 512), repeat=repeat, log=say)
    result["scale_3v1"] = scale["scale_3v1"]
    result["details"].update(scale.get("details", {}))
    result["report"] = {
        "T1": {"what": "pull vs raw TCP (best of gRPC/HTTP)", "value": f"{result['T1']:.2f}x", "target": ">= 0.5x"},
        "T1_grpc": {"what": "pull over gRPC vs raw TCP", "value": f"{t1_grpc:.2f}x", "target": ""},
        "T1_http": {"what": "pull over HTTP vs raw TCP", "value": f"{t1_http:.2f}x", "target": ""},
        "T2": {"what": "push fp32 -> committed vs raw TCP", "value": f"{result['T2']:.2f}x", "target": ">= 0.4x"},
        "T3": {
            "what": f"{PULLERS} pullers at once vs {PULLERS} raw TCP streams, aggregate (best of gRPC/HTTP)",
            "value": f"{result['T3']:.2f}x (grpc {t3_grpc:.2f}x, http {t3_http:.2f}x)",
            "target": ">= 0.4x",
        },
        "K1": {"what": "fused sr bf16 export vs x.to(bfloat16)", "value": f"{kernels['K1']:.2f}x", "target": ">= 0.8x"},
        "K2": {"what": "fused ef bf16 export vs x.to(bfloat16)", "value": f"{kernels['K2']:.2f}x", "target": ">= 0.4x"},
        "K1_vs_torch_ops_sr": {
            "what": "fused sr vs sr composed from torch ops",
            "value": f"{kernels['K1_vs_torch_ops_sr']:.1f}x faster",
            "target": "",
        },
        "scale_3v1": {
            "what": f"{PULLERS} pullers from 3 sharded replicas vs from 1, aggregate",
            "value": "no Redis" if result["scale_3v1"] is None else f"{result['scale_3v1']:.2f}x",
            "target": f"cores here: {os.cpu_count()}",
        },
        "M1": {
            "what": f"server peak RSS {peak >> 20} MiB / bound {int(bound) >> 20} MiB",
            "value": f"{result['M1']:.2f}",
            "target": "<= 1.0",
        },
    }
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
    }  # fmt: skip


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
