"""The transfer figures, the service in a process of its own as in production.

- T2: push an fp32 model until committed (export included), over gRPC and over HTTP, vs raw TCP
  loopback on the same bytes.
- T1: pull the committed version (gRPC and HTTP, checksums verified) vs raw TCP on the served bytes.
- T3: 8 puller processes at once, aggregate, vs 8 raw TCP streams from one process at once.
- M1: the server's peak RSS against 1.25 x retained bytes + 300 MiB.
- P1: the clients' pull into memory vs raw TCP into a preallocated buffer; for reference, the same
  file from nginx (sendfile) to the same client.
"""

from __future__ import annotations

import os
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsvc.cli.bench._common import PULLERS, best, best_seconds, row, serve
from weightsvc.cli.bench.loop import loop_lag, loop_lag_max_s
from weightsvc.cli.bench.nginx import NO_NGINX, Nginx, nginx_exe
from weightsvc.cli.bench.peers import Pullers
from weightsvc.cli.bench.rawtcp import RECV_PIECE, RawTcp
from weightsvc.client import InferenceClient, LearnerClient, tensors_from_data
from weightsvc.memory import alloc

if TYPE_CHECKING:
    import torch


def transfer_bench(model: dict[str, torch.Tensor], *, repeat: int, retain: int, tcp: RawTcp,
                   say: Callable[[str], Any]) -> dict[str, Any]:
    """T1, T2, T3 and M1 on one server."""
    master_bytes = sum(t.numel() * 4 for t in model.values())
    server = serve(retain)
    try:
        learners = {"grpc": LearnerClient(server.target), "http": LearnerClient(server.url)}
        step = [0]

        def push_once(learner: LearnerClient) -> float:
            step[0] += 1
            start = time.perf_counter()
            learner.push(step[0], model)
            return time.perf_counter() - start

        # Warm-up (kernel compile, allocator) until retention is full: a serving process lives in
        # that steady state, and the peak RSS is read in it.
        for _ in range(retain):
            push_once(learners["grpc"])
        warm = loop_lag(server.url)
        pushes = {t: best(lambda c=c: push_once(c), repeat) for t, c in learners.items()}  # type: ignore[misc]
        push_s = min(pushes.values())
        served_bytes = InferenceClient(server.url).manifest().data_bytes
        say("push: " + ", ".join(f"{t} {master_bytes / v / 1e9:.2f} GB/s" for t, v in pushes.items()))

        def pull_once(target: str) -> float:
            client = InferenceClient(target)
            start = time.perf_counter()
            manifest, data = client.pull_data()
            tensors_from_data(manifest, data)  # checksum verification is part of a pull
            elapsed = time.perf_counter() - start
            client.close()
            return elapsed

        pull_grpc_s = best(lambda: pull_once(server.target), repeat)
        pull_http_s = best(lambda: pull_once(server.url), repeat)
        say(f"pull: grpc {served_bytes / pull_grpc_s / 1e9:.2f} GB/s, http {served_bytes / pull_http_s / 1e9:.2f} GB/s")
        peak = server.memory()["VmHWM"]  # M1: one learner and one puller at a time
        with Pullers(PULLERS) as pullers:
            fanout_grpc_s = best(lambda: pullers.seconds(server.target), repeat)
            fanout_http_s = best(lambda: pullers.seconds(server.url), repeat)
        say(f"{PULLERS} pullers at once: grpc {PULLERS * served_bytes / fanout_grpc_s / 1e9:.2f} GB/s, "
            f"http {PULLERS * served_bytes / fanout_http_s / 1e9:.2f} GB/s")
        peak_fanout = server.memory()["VmHWM"]  # with the gRPC streams of 8 pullers in flight too
        retained = sum(v.data_bytes for v in InferenceClient(server.url).versions())
        lag = loop_lag_max_s(server.url, warm)
        for learner in learners.values():
            learner.close()
    finally:
        server.stop()

    tcp_up_s, tcp_down_s = tcp.up(master_bytes), tcp.down(served_bytes)
    tcp_fanout_s = tcp.fanout(served_bytes, PULLERS)
    say(f"raw tcp: up {master_bytes / tcp_up_s / 1e9:.2f} GB/s, down {served_bytes / tcp_down_s / 1e9:.2f} GB/s")
    bound = 1.25 * retained + (300 << 20)
    t1_grpc, t1_http = tcp_down_s / pull_grpc_s, tcp_down_s / pull_http_s
    t3_grpc, t3_http = tcp_fanout_s / fanout_grpc_s, tcp_fanout_s / fanout_http_s
    t1, t2, t3, m1 = max(t1_grpc, t1_http), tcp_up_s / push_s, max(t3_grpc, t3_http), peak / bound
    t2_grpc, t2_http = tcp_up_s / pushes["grpc"], tcp_up_s / pushes["http"]
    return {
        "T1": round(t1, 3),
        "T1_grpc": round(t1_grpc, 3),
        "T1_http": round(t1_http, 3),
        "T2": round(t2, 3),
        "T2_grpc": round(t2_grpc, 3),
        "T2_http": round(t2_http, 3),
        "T3": round(t3, 3),
        "T3_grpc": round(t3_grpc, 3),
        "T3_http": round(t3_http, 3),
        "M1": round(m1, 3),
        "details": {
            "master_mib": master_bytes >> 20,
            "served_mib": served_bytes >> 20,
            "rounding": "sr",
            "format": "bf16",
            "push_grpc_gbps": round(master_bytes / pushes["grpc"] / 1e9, 3),
            "push_http_gbps": round(master_bytes / pushes["http"] / 1e9, 3),
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
            "T1": row("pull vs raw TCP (best of gRPC/HTTP)", f"{t1:.2f}x", ">= 0.5x"),
            "T1_grpc": row("pull over gRPC vs raw TCP", f"{t1_grpc:.2f}x"),
            "T1_http": row("pull over HTTP vs raw TCP", f"{t1_http:.2f}x"),
            "T2": row("push fp32 -> committed vs raw TCP (best of gRPC/HTTP)",
                      f"{t2:.2f}x (grpc {t2_grpc:.2f}x, http {t2_http:.2f}x)", ">= 0.6x"),
            "T3": row(
                f"{PULLERS} pullers at once vs {PULLERS} raw TCP streams, aggregate (best of gRPC/HTTP)",
                f"{t3:.2f}x (grpc {t3_grpc:.2f}x, http {t3_http:.2f}x)",
                ">= 0.4x",
            ),
            "M1": row(f"server peak RSS {peak >> 20} MiB / bound {int(bound) >> 20} MiB", f"{m1:.2f}", "<= 1.0"),
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
        while n := resp.readinto(buf[got : got + RECV_PIECE]):
            got += n
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
    if resp.status != 200 or got != len(buf):
        raise RuntimeError(f"GET {url}{path}: status {resp.status}, {got} of {len(buf)} bytes")
    return elapsed


def pull_bench(model: dict[str, torch.Tensor], *, repeat: int, tcp: RawTcp,
               say: Callable[[str], Any]) -> dict[str, Any]:
    """P1: `InferenceClient.pull` (into memory, checksums verified) over HTTP and gRPC vs raw TCP into
    a preallocated buffer; what the transfer alone costs (`pull_data`, no verification); and a plain
    http.client read into a preallocated buffer, and into a fresh one as a pull's (mapping it is part
    of the pull). For reference, the same served file from nginx (sendfile on) to the same HTTP client
    and the same plain read."""
    def timed(fn: Callable[[], object]) -> float:
        return best_seconds(fn, repeat)

    seconds: dict[str, float] = {}
    nginx_skipped = None
    with tempfile.TemporaryDirectory(prefix="weightsvc-bench-") as d:
        server = serve(2)
        try:
            with LearnerClient(server.target) as learner:
                version = learner.push(1, model).version
            warm = loop_lag(server.url)
            for t, target in (("grpc", server.target), ("http", server.url)):
                with InferenceClient(target) as client:
                    client.manifest()  # connected before the clock starts
                    seconds[f"pull_{t}"] = timed(lambda c=client: c.pull(version=version))  # type: ignore[misc]
                    seconds[f"pull_data_{t}"] = timed(lambda c=client: c.pull_data(version=version))  # type: ignore[misc]
            # The nginx root holds the file at the service's own path: the same client pulls from both.
            path = f"/v1/models/default/versions/{version}/safetensors"
            os.makedirs(f"{d}/root{os.path.dirname(path)}")
            os.makedirs(f"{d}/tmp")
            with InferenceClient(server.url) as client:
                served_bytes = client.pull_file(f"{d}/root{path}", version=version).data_bytes
            file_bytes = os.path.getsize(f"{d}/root{path}")
            buf = alloc(file_bytes)
            seconds["plain_http"] = best(lambda: _plain_http_seconds(server.url, path, file_bytes, buf), repeat)
            seconds["plain_http_fresh"] = best(lambda: _plain_http_seconds(server.url, path, file_bytes), repeat)
            lag = loop_lag_max_s(server.url, warm)
        finally:
            server.stop()
        if nginx_exe() is None:
            nginx_skipped = NO_NGINX
        else:
            for sub in ("", "/root", "/root/v1", "/root/v1/models"):  # nginx's workers may run as nobody
                os.chmod(f"{d}{sub}", 0o755)
            nginx = Nginx(d)
            try:
                with InferenceClient(nginx.url) as client:
                    seconds["pull_nginx"] = timed(lambda c=client: c.pull(version=version))  # type: ignore[misc]
                seconds["plain_nginx"] = best(lambda: _plain_http_seconds(nginx.url, path, file_bytes, buf), repeat)
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
            "P1_http": row(
                "InferenceClient.pull over HTTP (verified) vs raw TCP into a preallocated buffer",
                f"{ratio['pull_http']:.2f}x (transfer alone {ratio['pull_data_http']:.2f}x)",
                ">= 0.8x",
            ),
            "P1_grpc": row(
                "InferenceClient.pull over gRPC (verified) vs raw TCP into a preallocated buffer",
                f"{ratio['pull_grpc']:.2f}x (transfer alone {ratio['pull_data_grpc']:.2f}x)",
                ">= 0.6x",
            ),
            "P1_nginx": row(
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
