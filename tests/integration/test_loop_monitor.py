"""The event loop is watched: a call that blocks it shows in `weightsvc_event_loop_lag_seconds`, and
the probes, answered off the loop, tell a busy loop (alive, ready) from a wedged one."""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from threading import Event

import pytest

from tests.conftest import serving
from tests.helpers import http_get
from weightsvc.cli.bench.loop import HealthPoller
from weightsvc.server.server import BackgroundServer


def loop_lag(metrics_text: str) -> tuple[float, float, dict[str, float]]:
    """(count, sum, cumulative count per bucket bound) of the loop-lag histogram."""
    count = total = 0.0
    buckets: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("weightsvc_event_loop_lag_seconds_count"):
            count = float(line.split()[-1])
        elif line.startswith("weightsvc_event_loop_lag_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("weightsvc_event_loop_lag_seconds_bucket"):
            buckets[line.split('le="')[1].split('"')[0]] = float(line.split()[-1])
    return count, total, buckets


def watch_observations(srv: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> tuple[Event, Event]:
    """Events the monitor's observations set: any observation, and one of a block of 0.4 s or more."""
    any_lag, long_lag = Event(), Event()
    histogram = srv.service.metrics.event_loop_lag
    observe = histogram.observe

    def observed(lag: float) -> None:
        observe(lag)
        any_lag.set()
        if lag >= 0.4:
            long_lag.set()

    monkeypatch.setattr(histogram, "observe", observed)
    return any_lag, long_lag


def test_a_blocked_event_loop_shows_in_the_loop_lag_histogram(monkeypatch: pytest.MonkeyPatch) -> None:
    with serving() as srv:
        any_lag, long_lag = watch_observations(srv, monkeypatch)
        assert any_lag.wait(30)  # the monitor's timer has fired
        count_before, _, before = loop_lag(http_get(srv.http_url, "/metrics")[2].decode())
        assert count_before > 0

        async def block() -> None:
            time.sleep(0.5)  # what a blocking call on the loop does to everyone

        srv.call(block())
        assert long_lag.wait(30)  # the monitor's timer fires after the block
        count, total, after = loop_lag(http_get(srv.http_url, "/metrics")[2].decode())
        assert count > count_before
        assert total >= 0.4
        # One observation of at least 0.25 s: the block, not a spread of small ones.
        assert after["0.25"] - before["0.25"] < count - count_before


@contextmanager
def loop_held(srv: BackgroundServer) -> Iterator[None]:
    """The server's event loop blocked by a call on it, until the block ends."""
    entered, release = Event(), Event()

    def hold() -> None:
        entered.set()
        release.wait()

    srv.loop.call_soon_threadsafe(hold)
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()


def test_the_probes_answer_while_the_event_loop_is_held() -> None:
    """A big push or pull may keep the loop busy for a while (1 s and more): the probe port is answered
    by a process of its own, so a Kubernetes probe never fails a busy server."""
    with serving() as srv, loop_held(srv):
        status, _, body = http_get(srv.server.probe_url, "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, _, body = http_get(srv.server.probe_url, "/readyz")
        assert status == 200 and json.loads(body) == {"status": "ready", "device": "cpu"}
        assert http_get(srv.server.probe_url, "/metrics")[0] == 404  # the probes alone, no data


def test_the_probes_answer_while_the_server_holds_its_gil() -> None:
    """The work of a big push or pull holds the server's GIL (or its memory-map lock) for a second and
    more at a time: a probe answered by a thread of the server waited for it (/healthz 1.05 s during a
    100,000-tensor push). The loop here holds the GIL 2 s in one C call (ctypes.PyDLL keeps it), while
    processes of their own poll the probe port, answered by the server's probe process, and the HTTP
    port, answered on the loop."""
    with serving() as srv:
        probes, http = HealthPoller(srv.server.probe_url), HealthPoller(srv.http_url)

        async def hold_the_gil() -> None:
            ctypes.PyDLL(None).usleep(2_000_000)

        srv.call(hold_the_gil())
        worst_probe, worst_http = probes.worst(), http.worst()
    assert worst_http >= 1.0  # the hold held
    assert worst_probe < 1.0, f"/healthz on the probe port took {worst_probe:.2f} s"  # (Kubernetes' default timeout)


def test_a_wedged_event_loop_fails_both_probes_until_it_turns_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(loop_wedged_s=2.0) as srv:
        any_lag, _ = watch_observations(srv, monkeypatch)
        with loop_held(srv):
            time.sleep(2.1)  # (what is awaited is time itself: the loop has not turned for longer than 2 s)
            for path in ("/healthz", "/readyz"):
                status, _, body = http_get(srv.server.probe_url, path)
                assert status == 503, path
                assert json.loads(body)["error"]["message"].startswith("the event loop has not turned for 2."), body
        any_lag.clear()
        assert any_lag.wait(30)  # the monitor's timer fired: the loop turns again
        assert http_get(srv.server.probe_url, "/healthz")[0] == 200
        assert http_get(srv.server.probe_url, "/readyz")[0] == 200
