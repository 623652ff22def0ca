"""S2: the server's anonymous RSS with --data-dir against the bytes it retains, for several --retain
(M1, the peak RSS without one, is measured by the transfer part on its server)."""

from __future__ import annotations

import functools
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsvc.cli._server import ServeProcess
from weightsvc.cli.bench._common import row, serve, slope
from weightsvc.cli.bench.loop import loop_lag, loop_lag_max_s
from weightsvc.client import InferenceClient, LearnerClient

if TYPE_CHECKING:
    import torch


def _push_steps(learner: LearnerClient, model: dict[str, torch.Tensor], first: int, last: int) -> None:
    for step in range(first, last + 1):
        learner.push(step, model)


def _peak_anon_rss(server: ServeProcess, work: Callable[[], object]) -> int:
    """The server's peak anonymous RSS while `work` runs, sampled every 50 ms (there is no HWM of it)."""
    samples = [server.memory()["RssAnon"]]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            samples.append(server.memory()["RssAnon"])

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
    pushes = max(retains) + 1  # the same pushes for every --retain: each fills its retention and evicts
    anon: dict[int, int] = {}
    peak: dict[int, int] = {}
    retained: dict[int, int] = {}
    lags = []
    for k in retains:
        with tempfile.TemporaryDirectory(prefix="weightsvc-bench-") as data_dir:
            server = serve(k, "--data-dir", data_dir)
            try:
                with LearnerClient(server.target) as learner:
                    learner.push(1, model)  # warm-up: kernels compiled
                    warm = loop_lag(server.url)
                    peak[k] = _peak_anon_rss(server, functools.partial(_push_steps, learner, model, 2, pushes))
                time.sleep(0.5)  # what a push left behind to free, freed
                anon[k] = server.memory()["RssAnon"]
                peak[k] = max(peak[k], anon[k])  # (the peak is sampled: the last reading counts too)
                retained[k] = sum(v.data_bytes for v in InferenceClient(server.url).versions())
                lags.append(loop_lag_max_s(server.url, warm))
            finally:
                server.stop()
        say(f"S2: --retain {k}: anonymous RSS {anon[k] >> 20} MiB (peak {peak[k] >> 20}) "
            f"holding {retained[k] >> 20} MiB")
    xs = [float(retained[k]) for k in retains]
    s2 = slope(xs, [float(anon[k]) for k in retains]) if len(set(xs)) > 1 else 0.0
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
            "S2": row(
                "anonymous RSS per retained byte, --data-dir, --retain " + "/".join(map(str, retains)),
                f"{s2:.3f} (" + ", ".join(f"{anon[k] >> 20} MiB" for k in retains) + ")",
                "~0: independent of --retain",
            ),
        },
    }
