"""L1: how long a server's event loop was blocked, at most, read from its lag histogram."""

from __future__ import annotations

import urllib.request
from typing import Any

from weightsvc.cli.bench._common import row

L1_TARGET_S = 0.1
Histogram = list[tuple[float, float]]


def loop_lag(url: str) -> Histogram:
    """The event loop's lag histogram so far: (bucket bound, wake-ups up to it), cumulative."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sorted(
        (float(s.labels["le"]), s.value)
        for f in text_string_to_metric_families(text)
        if f.name == "weightsvc_event_loop_lag_seconds"
        for s in f.samples
        if s.name.endswith("_bucket")
    )


def loop_lag_max_s(url: str, since: Histogram | None = None) -> float:
    """The longest the event loop was blocked (since the histogram `since`), rounded up to its bucket."""
    now = loop_lag(url)
    if since is not None:
        now = [(le, count - before) for (le, count), (_, before) in zip(now, since, strict=True)]
    total = now[-1][1]  # le="+Inf": every wake-up
    return next(le for le, count in now if count == total)


def l1(result: dict[str, Any]) -> None:
    """L1 into `result`: the longest block of the event loop, over every server of the run after its
    first push (the parts' `loop_lag_max_s_*` details); nothing when no part started a server."""
    lags = [v for k, v in result["details"].items() if k.startswith("loop_lag_max_s_")]
    if lags:
        result["L1"] = max(lags)
        result["report"]["L1"] = row("event loop blocked at most (bucket), every server after its first push",
                                     f"<= {max(lags) * 1000:.0f} ms", f"<= {L1_TARGET_S * 1000:.0f} ms")
