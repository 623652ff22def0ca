"""`weightsvc bench`: the chosen figures, each part measured by its module, as one JSON-able dict."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsvc.cli.bench import (
    PARTS,
    delta,
    fabric,
    kernels,
    loop,
    memory,
    publish,
    sass,
    scale,
    store,
    sync,
    transfer,
)
from weightsvc.cli.bench._common import make_model
from weightsvc.cli.bench.rawtcp import RawTcp


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
    if parts & {"transfer", "E1", "P1", "S2", "store"}:
        model = make_model(size_mib)
        say(f"model: {len(model)} tensors, {sum(t.numel() * 4 for t in model.values()) / 2**20:.0f} MiB fp32")
    tcp = RawTcp(repeat)  # measured once for every figure that compares with it
    # E1 and S1: best of 3 and 2 at most; each run of 8 pullers, and of 100,000 tensors, takes seconds.
    measures: dict[str, Callable[[], dict[str, Any]]] = {
        "transfer": lambda: transfer.transfer_bench(model, repeat=repeat, retain=retain, tcp=tcp, say=say),
        "E1": lambda: sync.sync_bench(model, pullers=pullers, repeat=min(repeat, 3), tcp=tcp, say=say),
        "P1": lambda: transfer.pull_bench(model, repeat=repeat, tcp=tcp, say=say),
        "S1": lambda: sync.tensor_cost_bench(total_mib=s1_mib, counts=s1_tensors, repeat=min(repeat, 2), say=say),
        "S2": lambda: memory.data_dir_rss_bench(model, retains=s2_retains, say=say),
        "kernels": lambda: kernels.kernels_part(repeat=repeat, say=say),
        "delta": delta.delta_bench,
        "sass": lambda: sass.sass_bench(say=say),
        "scale": lambda: scale.scale_bench(size_mib=min(size_mib, 512), repeat=repeat, log=say),
        "store": lambda: store.store_bench(model, repeat=repeat, say=say),
        "N1": lambda: fabric.fabric_bench(size_mib=size_mib, repeat=repeat, say=say),
        "N2": lambda: fabric.quarters_bench(size_mib=size_mib, repeat=repeat, say=say),
        "N3": lambda: fabric.control_bench(counts=(1_000, 100_000), repeat=min(repeat, 2), say=say),
        "PUB1": lambda: publish.pub1_bench(size_mib=min(size_mib, 256), repeat=repeat, say=say),
        "PUB2": lambda: publish.publish_bench(size_mib=min(size_mib, 256), say=say),  # (bytes: its size is moot)
    }
    result: dict[str, Any] = {"details": {"cpus": os.cpu_count()}, "report": {}}
    for name, measure in measures.items():
        if name not in parts:
            continue
        started = time.monotonic()
        part = measure()
        result["details"].update(part.pop("details", {}))
        result["details"][f"seconds_{name}"] = round(time.monotonic() - started, 1)  # what a run costs
        result["report"].update(part.pop("report", {}))
        result.update(part)
    loop.l1(result)
    return result
