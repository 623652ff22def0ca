"""L1: how long a server's event loop was blocked, at most, read from its lag histogram; and how long
/healthz took to answer meanwhile, on the probe port (answered off the loop) and on the HTTP port."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.request
from typing import Any

from weightsvc.cli.bench._common import row

L1_TARGET_S = 0.1
Histogram = list[tuple[float, float]]
_POLL = textwrap.dedent("""
    import select, sys, time, urllib.request
    url, worst = sys.argv[1], 0.0
    urllib.request.urlopen(url + "/healthz", timeout=60).read()  # (its first request loads urllib's parts)
    print("polling", flush=True)
    while True:
        start = time.perf_counter()
        urllib.request.urlopen(url + "/healthz", timeout=60).read()
        worst = max(worst, time.perf_counter() - start)
        if select.select([sys.stdin], [], [], 0.05)[0]:
            break
    print(worst, flush=True)
""")


class HealthPoller:
    """Asks `url`/healthz every 50 ms from a process of its own (a thread here would compete with the
    clients under test for this process's GIL); `worst()` stops it and answers the slowest answer, in s."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _POLL, url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "polling"

    def worst(self) -> float:
        out, _ = self.proc.communicate("stop\n", timeout=120)
        return float(out.strip())


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
    probes = {k.removeprefix("probe_worst_s_"): v for k, v in result["details"].items()
              if k.startswith("probe_worst_s_")}
    if probes:
        http = {k: result["details"].get(f"http_healthz_worst_s_{k}") for k in probes}
        result["L1_probes"] = max(probes.values())
        result["report"]["L1_probes"] = row(
            "/healthz answered within, worst, polled every 50 ms during the pushes and pulls of "
            f"{' and '.join(probes)}: on the probe port (off the event loop; the HTTP port's, from the loop)",
            f"{max(probes.values()) * 1000:.0f} ms ({', '.join(f'{k} {v * 1000:.0f}' for k, v in probes.items())}; "
            f"HTTP port {', '.join(f'{k} {(v or 0) * 1000:.0f}' for k, v in http.items())})",
            f"<= {L1_TARGET_S * 1000:.0f} ms")
