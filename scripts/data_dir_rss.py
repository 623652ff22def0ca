"""Anonymous memory of a server with --data-dir as --retain grows: pushes versions of one size and
samples the server's RssAnon (and RssFile) while it runs.

    python scripts/data_dir_rss.py --size-mib 4096 --retain 8 --pushes 10 [--pull]
    python scripts/data_dir_rss.py --size-mib 16384 --max-rss-mib 4096 --retain 2 --pushes 2 --views

`--size-mib` is the fp32 size pushed (the bf16 version is half of it). `--views`: the masters are
overlapping views of one 1 GiB tensor (each its own memory to the client, so pushed as distinct
tensors), so a push larger than this machine's memory needs no more than 1 GiB in the learner.
The data dir is a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import torch

from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli._server import ServeProcess
from weightsvc.memory import process_status


def rss(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of `pid`, in bytes."""
    sizes = process_status(pid)
    return {k: sizes[k] for k in ("RssAnon", "RssFile")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--retain", type=int, default=8)
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--max-rss-mib", type=int, default=0)
    p.add_argument("--pull", action="store_true", help="pull each version over HTTP after its push")
    p.add_argument("--views", action="store_true", help="masters as views of one 1 GiB tensor")
    a = p.parse_args()
    tensors = max(1, a.size_mib // 64)
    cols = a.size_mib * 1024 * 1024 // 4 // tensors // 4096
    if a.views:
        base = torch.randn(1 << 28)
        step = (base.numel() - 4096 * cols) // tensors
        masters = {f"layers.{i}.weight": base[i * step : i * step + 4096 * cols].view(4096, cols)
                   for i in range(tensors)}
    else:
        masters = {f"layers.{i}.weight": torch.randn(4096, cols) for i in range(tensors)}
    with tempfile.TemporaryDirectory(dir="/tmp") as data_dir:
        # (the masters of a version may be larger than the default limit)
        args = ["--data-dir", data_dir, "--retain", str(a.retain), "--max-version-bytes", str(2 * a.size_mib << 20)]
        if a.max_rss_mib:
            args += ["--max-rss-bytes", str(a.max_rss_mib << 20)]
        server = ServeProcess(*args)
        pid, peak, stop = server.proc.pid, {"RssAnon": 0, "RssFile": 0}, threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                for k, v in rss(pid).items():
                    peak[k] = max(peak[k], v)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        base = rss(pid)
        rows = []
        try:
            with LearnerClient(server.target) as learner, InferenceClient(server.url) as puller:
                for step in range(1, a.pushes + 1):
                    t = time.perf_counter()
                    learner.push(step, masters, model="big")
                    pushed = time.perf_counter() - t
                    if a.pull:
                        puller.pull("big", step)
                    rows.append({"step": step, "push_s": round(pushed, 2), **rss(pid)})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            stop.set()
            sampler.join()
            server.stop()
    mib = {k: v >> 20 for k, v in peak.items()}
    print(json.dumps({"size_mib_fp32": a.size_mib, "retain": a.retain, "pushes": a.pushes,
                      "base_anon_mib": base["RssAnon"] >> 20, "peak_anon_mib": mib["RssAnon"],
                      "peak_file_mib": mib["RssFile"]}))


if __name__ == "__main__":
    main()
