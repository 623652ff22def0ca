"""Crash recovery: the server is SIGKILLed during a push, at each point of a commit, and during a
pull, then restarted on its data dir. Committed versions come back intact (every checksum is
verified by the client), nothing partial is visible, the ef residual continues from the last
committed version, and clients carry on."""

from __future__ import annotations

import http.client
import os
import signal
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ServeProcess, make_masters
from weightsvc import InferenceClient, LearnerClient
from weightsvc._faults import POINTS
from weightsvc.errors import WeightsvcError
from weightsvc.rounding import ExportSpec, Residual, export_state_dict

MODEL = "crash"


def masters(step: int) -> dict[str, torch.Tensor]:
    """A learner's masters at `step`: a few MiB, moving a little every step."""
    base = make_masters(seed=1)
    base["layers.0.mlp.down.weight"] = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(2)) * 0.02
    return {n: t + 1e-4 * step * torch.sign(t) for n, t in base.items()}


def expected_ef(steps: list[int]) -> dict[str, torch.Tensor]:
    """The served bits of the last of `steps`, the ef chain over exactly the committed steps."""
    residual, out = Residual(), {}
    for step in steps:
        out = export_state_dict(masters(step), ExportSpec("bf16", "ef"), version=step, residual=residual)
    return out


def assert_served(target: str, step: int, committed: list[int]) -> None:
    pulled = InferenceClient(target).pull(MODEL, step)  # checksums verified
    want = expected_ef(committed[: committed.index(step) + 1])
    for name, t in want.items():
        assert np.array_equal(pulled[name].view(torch.int16).numpy(), t.view(torch.int16).numpy()), name


def file_bytes(url: str, version: int) -> bytes:
    with urllib.request.urlopen(f"{url}/v1/models/{MODEL}/versions/{version}/safetensors", timeout=30) as resp:
        return bytes(resp.read())


def leftovers(data: Path) -> list[str]:
    return sorted(p.name for p in (data / "models" / MODEL).glob(".*"))


def serve(data: Path, crash_at: str = "") -> ServeProcess:
    env = {"WEIGHTSVC_CRASH_AT": crash_at} if crash_at else {}
    return ServeProcess("--data-dir", str(data), "--rounding", "ef", "--retain", "8", env=env)


def test_sigkill_during_a_push_keeps_what_was_committed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    srv = serve(data)
    learner = LearnerClient(srv.target, chunk_bytes=64 << 10)
    for step in (1, 2):
        learner.push(step, masters(step), model=MODEL)
    before = {v: file_bytes(srv.url, v) for v in (1, 2)}
    sent = [0]

    def power_cut(n: int) -> None:
        sent[0] += n
        if sent[0] > 1 << 20:
            srv.kill()

    with pytest.raises(WeightsvcError):
        learner.push(3, masters(3), model=MODEL, progress=power_cut)
    srv = serve(data)
    try:
        assert [v.version for v in InferenceClient(srv.target).versions(MODEL)] == [1, 2]
        for v, raw in before.items():
            assert file_bytes(srv.url, v) == raw
        assert leftovers(data) == []
        # The learner pushes step 3 again: it continues the ef chain of 1, 2.
        assert LearnerClient(srv.target).push(3, masters(3), model=MODEL).created
        assert_served(srv.target, 3, [1, 2, 3])
    finally:
        srv.stop()


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_each_point_of_a_commit(tmp_path: Path, point: str) -> None:
    data = tmp_path / "data"
    srv = serve(data)
    LearnerClient(srv.target).push(1, masters(1), model=MODEL)
    srv.stop()
    srv = serve(data, crash_at=point)
    with pytest.raises(WeightsvcError):  # the learner never hears back
        LearnerClient(srv.target).push(2, masters(2), model=MODEL)
    assert srv.died() == -signal.SIGKILL
    srv = serve(data)
    try:
        versions = [v.version for v in InferenceClient(srv.target).versions(MODEL)]
        # Durable before visible: once the version file is in place the commit stands (the
        # learner's retry is then idempotent); before that, nothing of step 2 exists.
        on_disk = point in ("commit.version-renamed", "commit.visible")
        assert versions == ([1, 2] if on_disk else [1])
        assert leftovers(data) == []
        retried = LearnerClient(srv.target).push(2, masters(2), model=MODEL)
        assert retried.created is not on_disk
        LearnerClient(srv.target).push(3, masters(3), model=MODEL)
        for step in (1, 2, 3):
            assert_served(srv.target, step, [1, 2, 3])
        residuals = sorted(p.name for p in (data / "models" / MODEL).glob("residual-*"))
        assert residuals == [f"residual-{3:020d}.safetensors"]
    finally:
        srv.stop()


def test_sigkill_during_a_pull_then_the_client_resumes_on_the_restarted_server(tmp_path: Path) -> None:
    data = tmp_path / "data"
    srv = serve(data)
    LearnerClient(srv.target).push(1, masters(1), model=MODEL)
    path = f"/v1/models/{MODEL}/versions/1/safetensors"
    head = urllib.request.urlopen(srv.url + path, timeout=30)
    etag, size = head.headers["etag"], int(head.headers["content-length"])
    first = head.read(size // 2)  # half the file, then the server dies
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.died()
    with pytest.raises(WeightsvcError):
        InferenceClient(srv.target, resume_attempts=0).pull(MODEL, 1)
    srv = serve(data)
    try:
        # HTTP: the rest of the same file, by Range, since its ETag still matches.
        u = urllib.parse.urlsplit(srv.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("GET", path, headers={"Range": f"bytes={len(first)}-", "If-Range": etag or ""})
        rest = conn.getresponse()
        assert rest.status == 206
        whole = first + rest.read()
        conn.close()
        assert whole == file_bytes(srv.url, 1)
        assert_served(srv.target, 1, [1])  # and a fresh gRPC pull verifies
    finally:
        srv.stop()
