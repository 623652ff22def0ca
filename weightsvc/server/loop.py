"""Watches the event loop: every transport, watch stream and commit shares it, so any call that
blocks it stalls them all. A timer asks to be woken every `CHECK_EVERY_S`; how late it wakes is how
long the loop was blocked (`weightsvc_event_loop_lag_seconds`). A block of d seconds shows as at
least d - CHECK_EVERY_S. The garbage collector's pauses, one common cause, are timed too
(`weightsvc_gc_pause_seconds`). Each wake-up is told to `turned` (the probes': how long ago the
loop last turned)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

from weightsvc.metrics import Metrics

log = logging.getLogger("weightsvc.loop")

CHECK_EVERY_S = 0.05
WARN_AFTER_S = 1.0  # a block this long is logged (with the metric, it names the moment)


async def monitor(metrics: Metrics, turned: Callable[[], None], every: float = CHECK_EVERY_S) -> None:
    loop = asyncio.get_running_loop()
    timed = _GcPauses(metrics)
    gc.callbacks.append(timed)
    try:
        while True:
            start = loop.time()
            await asyncio.sleep(every)
            turned()
            lag = max(0.0, loop.time() - start - every)
            metrics.event_loop_lag.observe(lag)
            if lag >= WARN_AFTER_S:
                log.warning("the event loop was blocked for %.2f s", lag)
    finally:
        gc.callbacks.remove(timed)


class _GcPauses:
    """A `gc.callbacks` entry: times each collection (they run in whichever thread allocated)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.metrics.gc_pause.labels(str(info["generation"])).observe(time.perf_counter() - self.started)
