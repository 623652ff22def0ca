"""E1: sync time, from the learner's push call until N watching puller processes hold the version,
vs the raw-TCP lower bound (the masters up, then the served bytes down to N at once), and vs what a
team without a service does (the learner writes the served copy to a local safetensors file, the
puller loads it). S1: push + pull
time per tensor, from the same total size split into more and more tensors."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsvc.cli.bench._common import best, row, serve, slope
from weightsvc.cli.bench.loop import HealthPoller, loop_lag, loop_lag_max_s
from weightsvc.cli.bench.peers import start_file_reader, start_watchers
from weightsvc.cli.bench.rawtcp import RawTcp
from weightsvc.client import InferenceClient, LearnerClient


def sync_bench(model: dict[str, torch.Tensor], *, pullers: tuple[int, ...], repeat: int, tcp: RawTcp,
               say: Callable[[str], Any]) -> dict[str, Any]:
    """E1: from the learner's push call until `n` puller processes, already watching, hold the new
    version (checksums verified), over gRPC and over HTTP (the learner and the pullers on the same
    transport), vs raw TCP moving the masters up and then the served bytes down to `n` receivers at
    once."""
    master_bytes = sum(t.numel() * 4 for t in model.values())
    server = serve(2)
    sync: dict[tuple[int, str], float] = {}
    commit: dict[tuple[int, str], float] = {}  # of the same run: the push call alone
    try:
        learners = {"grpc": LearnerClient(server.target), "http": LearnerClient(server.url)}
        step = 1
        learners["grpc"].push(step, model)  # warm-up: kernels compiled, buffers recycled from here on
        warm = loop_lag(server.url)

        def push_and_wait(learner: LearnerClient, procs: list[subprocess.Popen[str]]) -> tuple[float, float]:
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

        served_bytes = InferenceClient(server.url).manifest().data_bytes
        probes, http_port = HealthPoller(server.probes), HealthPoller(server.url)
        for n in pullers:
            for transport, target in (("grpc", server.target), ("http", server.url)):
                procs = start_watchers(target, step, n)
                try:
                    learner = learners[transport]
                    push_and_wait(learner, procs)  # every watcher connected, watching and warm
                    runs = [push_and_wait(learner, procs) for _ in range(repeat)]
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                sync[n, transport], commit[n, transport] = min(runs)
                say(f"E1: {n} {transport} puller(s) hold the version {sync[n, transport]:.2f} s after the push call "
                    f"(commit at {commit[n, transport]:.2f} s)")
        lag = loop_lag_max_s(server.url, warm)
        probe_worst, http_worst = probes.worst(), http_port.worst()
        for learner in learners.values():
            learner.close()
    finally:
        server.stop()
    file_s = file_sync_seconds(model, repeat)
    out: dict[str, Any] = {"details": {"loop_lag_max_s_E1": lag, "probe_worst_s_E1": round(probe_worst, 4),
                                       "http_healthz_worst_s_E1": round(http_worst, 4),
                                       "e1_file_sync_s": round(file_s, 3)}, "report": {}}
    for n in pullers:
        bound = tcp.up(master_bytes) + tcp.fanout(served_bytes, n)
        ratios = {t: sync[n, t] / bound for t in ("grpc", "http")}
        lowest = min(ratios.values())
        out[f"E1_{n}"] = round(lowest, 3)
        for t, r in ratios.items():
            out[f"E1_{n}_{t}"] = round(r, 3)
            out["details"][f"e1_{n}_{t}_sync_s"] = round(sync[n, t], 3)
            out["details"][f"e1_{n}_{t}_commit_s"] = round(commit[n, t], 3)
        out["details"][f"e1_{n}_raw_tcp_bound_s"] = round(bound, 3)
        out["report"][f"E1_{n}"] = row(
            f"push call -> {n} watching puller(s) hold it, vs raw TCP up + down ({bound:.2f} s)",
            f"{lowest:.2f}x (grpc {sync[n, 'grpc']:.2f} s, http {sync[n, 'http']:.2f} s)",
            "<= 1.5x" if n == 1 else "<= 2.0x",
        )
    if 1 in pullers:
        best_sync = min(sync[1, t] for t in ("grpc", "http"))
        out["E1_1_vs_file"] = round(best_sync / file_s, 3)
        out["report"]["E1_1_vs_file"] = row(
            "push call -> 1 watching puller holds it, vs the learner writing the served copy (bf16, round to "
            f"nearest) to a local safetensors file and a reader process loading it ({file_s:.2f} s)",
            f"{best_sync / file_s:.2f}x", "reference",
        )
    out["details"]["e1_master_mib"] = master_bytes >> 20
    return out


def file_sync_seconds(model: dict[str, torch.Tensor], repeat: int) -> float:
    """The sync without a service, on one machine: from the learner's cast to bf16 (round to nearest,
    what everyone does) and `safetensors.torch.save_file` of it, until a reader process, already
    started, holds the file's tensors in memory. The file stays in the page cache (no fsync): the
    best case of a local disk; a shared file system only adds to it."""
    from safetensors.torch import save_file

    reader = start_file_reader()
    assert reader.stdin is not None and reader.stdout is not None
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="weightsvc-bench-") as d:
            for i in range(repeat):
                path = f"{d}/step-{i}.safetensors"
                start = time.monotonic()
                save_file({name: t.to(torch.bfloat16) for name, t in model.items()}, path)
                reader.stdin.write(path + "\n")
                reader.stdin.flush()
                runs.append(float(reader.stdout.readline()) - start)
                os.unlink(path)
    finally:
        reader.kill()
        reader.wait()
    return min(runs)


def tensor_cost_bench(*, total_mib: int, counts: tuple[int, ...], repeat: int,
                      say: Callable[[str], Any]) -> dict[str, Any]:
    """S1: push + pull (checksums verified) of `total_mib` fp32 split into each of `counts` tensors;
    the least-squares slope of the time on the count is the cost of one tensor, end to end."""
    gen = torch.Generator().manual_seed(0)
    elements = (total_mib << 20) // 4
    times: dict[str, list[float]] = {"push": [], "pull_grpc": [], "pull_http": []}
    server = serve(2)
    try:
        learner = LearnerClient(server.target)
        clients = {"grpc": InferenceClient(server.target), "http": InferenceClient(server.url)}
        step = 1
        learner.push(step, {"w": torch.zeros(1 << 16)})  # warm-up: kernels compiled
        warm = loop_lag(server.url)
        probes, http_port = HealthPoller(server.probes), HealthPoller(server.url)
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

            times["push"].append(best(lambda m=model: push_once(m), repeat))  # type: ignore[misc]
            for t, client in clients.items():
                times[f"pull_{t}"].append(best(lambda c=client: pull_once(c), repeat))  # type: ignore[misc]
            say(f"S1: {count} tensors: push {times['push'][-1]:.2f} s, pull grpc {times['pull_grpc'][-1]:.2f} s, "
                f"http {times['pull_http'][-1]:.2f} s")
        lag = loop_lag_max_s(server.url, warm)
        probe_worst, http_worst = probes.worst(), http_port.worst()
        for client in clients.values():
            client.close()
        learner.close()
    finally:
        server.stop()
    xs = [float(c) for c in counts]
    us = {k: slope(xs, v) * 1e6 for k, v in times.items()}
    s1 = {t: us["push"] + us[f"pull_{t}"] for t in ("grpc", "http")}
    lowest = min(s1.values())
    return {
        "S1": round(lowest, 2),
        "S1_grpc": round(s1["grpc"], 2),
        "S1_http": round(s1["http"], 2),
        "details": {
            "s1_total_mib": total_mib,
            "s1_tensors": list(counts),
            **{f"s1_{k}_s": [round(x, 4) for x in v] for k, v in times.items()},
            **{f"s1_{k}_us_per_tensor": round(v, 2) for k, v in us.items()},
            "loop_lag_max_s_S1": lag,
            "probe_worst_s_S1": round(probe_worst, 4),
            "http_healthz_worst_s_S1": round(http_worst, 4),
        },
        "report": {
            "S1": row(
                f"push + pull per tensor, {total_mib} MiB in {'/'.join(map(str, counts))} tensors (slope)",
                f"{lowest:.1f} us (push {us['push']:.1f}, pull grpc {us['pull_grpc']:.1f}, http {us['pull_http']:.1f})",
                "<= 40 us",
            ),
        },
    }
