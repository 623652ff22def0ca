"""One logging configuration, shared by weightsvc and uvicorn."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable


class RepeatLimit(logging.Filter):
    """At most `burst` records of one message (logger, level and template) per `window_s` seconds:
    a flood of one failure (a thousand connections a second that fail the same way) must not fill
    the disk. The next record of it let through says how many were left out."""

    def __init__(self, burst: int = 10, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._seen: dict[tuple[str, int, str], tuple[float, int, int]] = {}  # -> (window start, let through, left out)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        if len(self._seen) > 4096:  # (messages made with f-strings are all different: forget them)
            self._seen.clear()
        start, count, dropped = self._seen.get(key, (now, 0, 0))
        if now - start >= self.window_s:
            start, count = now, 0
        if count >= self.burst:
            self._seen[key] = (start, count, dropped + 1)
            return False
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it were left out of the log)"
        self._seen[key] = (start, count + 1, 0)
        return True


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RepeatLimit())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
