"""The log under a flood: one failure repeated a thousand times a second stays a few lines."""

from __future__ import annotations

import logging

from weightsvc._log import RepeatLimit


def record(msg: str, *args: object, level: int = logging.WARNING, name: str = "weightsvc.x") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_flood_of_one_message_is_cut_and_the_next_window_says_how_many_were_left_out() -> None:
    now = [0.0]
    limit = RepeatLimit(burst=3, window_s=10.0, clock=lambda: now[0])
    kept = [r for r in (record("accept failed: %s", i) for i in range(1000)) if limit.filter(r)]
    assert [r.getMessage() for r in kept] == ["accept failed: 0", "accept failed: 1", "accept failed: 2"]
    assert limit.filter(record("another message"))  # other messages, levels, loggers are counted apart
    assert limit.filter(record("accept failed: %s", 0, level=logging.ERROR))
    assert limit.filter(record("accept failed: %s", 0, name="weightsvc.y"))
    now[0] = 10.0
    first = record("accept failed: %s", 1000)
    assert limit.filter(first)
    assert first.getMessage() == "accept failed: 1000 (997 more like it were left out of the log)"
    assert sum(limit.filter(record("accept failed: %s", i)) for i in range(100)) == 2
