"""`weightsvc bench --soak`: one learner pushing and pullers pulling for a while; the server's memory
must stay flat and nothing may leak."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from weightsvc.cli.bench._common import PULLERS, make_model, serve
from weightsvc.client import InferenceClient, LearnerClient, tensors_from_data


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
    model = make_model(size_mib)
    server = serve(retain)
    stop = threading.Event()
    pushed, pulled, failures = [0], [0], []

    def learn() -> None:
        with LearnerClient(server.target) as learner:
            step = 0
            while step == 0 or not stop.is_set():  # the first version before the pullers start
                step += 1
                learner.push(step, {name: t + 1e-4 * step for name, t in model.items()})
                pushed[0] = step
                first.set()

    def pull(i: int) -> None:
        with InferenceClient(server.url if i % 2 else server.target) as client:
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
            samples.append((now, server.memory()["VmRSS"]))
            if warm_until is None and pushed[0] >= retain + 1 and now >= seconds / 5:
                warm_until = now
            stop.wait(0.5)
        stop.set()
        for t in threads:
            t.join(120)
        gauges = _scrape(server.url)
    finally:
        server.stop()
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
