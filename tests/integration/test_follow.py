"""`weightsvc follow` against engines that cannot follow: one that is not there, and one that takes
the connection and never answers. Each is a clear, counted failure naming the engine, the follower
stays up and not ready, and nothing is acked. (Real vLLM servers follow in tests/engines.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import serving
from weightsvc import LearnerClient
from weightsvc.server.server import BackgroundServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def service() -> Iterator[BackgroundServer]:
    with serving() as srv:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.randn(8, 8)}, model="policy")
        yield srv


def follow(engine: str, target: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "weightsvc", "follow", "--engine", engine, "--target", target,
                             "--model", "policy", "--listen", f"127.0.0.1:{port}", "--client-id", "f", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, f"http://127.0.0.1:{port}"


def first(proc: subprocess.Popen[str], event: str) -> dict[str, object]:
    assert proc.stdout is not None
    for line in proc.stdout:
        e = json.loads(line)
        if e["event"] == event:
            return e
    raise AssertionError(f"no {event}: {proc.stderr.read() if proc.stderr else ''}")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_an_unreachable_engine_is_reported_and_retried(service: BackgroundServer) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        engine = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc, url = follow(engine, service.grpc_target)
    try:
        failed = first(proc, "failed")
        assert failed["stage"] == "connect" and failed["engine"] == engine and failed["model"] == "policy"
        assert f"engine {engine}: GET /weight_info: unreachable" in str(failed["error"])
        status, body = get(f"{url}/ready")
        assert status == 503 and "not connected" in body
        assert 'weightsvc_follower_failures_total{stage="connect"}' in get(f"{url}/metrics")[1]
        assert get(f"{url}/healthz")[0] == 200
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert service.service.clients("policy") == []


def test_an_engine_that_never_answers_is_timed_out(service: BackgroundServer) -> None:
    with socket.socket() as silent:  # accepts (the kernel's backlog), never reads, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        engine = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc, _ = follow(engine, service.grpc_target, "--timeout-s", "0.5")
        try:
            failed = first(proc, "failed")
        finally:
            proc.terminate()
            proc.wait(30)
    assert failed["stage"] == "connect"
    assert f"engine {engine}: GET /weight_info: no answer within 0.5 s" == failed["error"]


@pytest.mark.parametrize(("args", "message"), [
    (["--engine", "http://e:1", "--pause-mode", "later"], "'later' is not one of keep, wait, abort"),
    (["--engine", "e:1"], "'e:1' is not an http:// or https:// URL"),
    (["--engine", "http://e:1", "--listen", "nowhere"], "'nowhere' is not HOST:PORT"),
])
def test_bad_flags_are_one_line_errors(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "weightsvc", "follow", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 2 and message in done.stderr
