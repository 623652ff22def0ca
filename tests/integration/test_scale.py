"""Models as they are: 50,000 tensors through push, commit, manifests, pulls (whole, delta, sliced,
over gRPC and HTTP), restart and relay, with /healthz answering throughout; and a version whose file
header safetensors could not read is refused before it commits.

50,000 tensors keep above every size the code switches at: the work goes off the loop
(`BIG_MANIFEST`) and JSON is made in slices (`JSON_SLICE`), 25 of each; the push header and the
manifest go in several 4 MiB pieces (`MESSAGE_PIECE_BYTES`), and a whole pull takes several reads.
The servers accept gRPC messages of 4.5 MiB (`LIMIT`): room for any piece, while the manifest in one
message (5.3 MB) would not pass, as 100,000 tensors' would not pass the default 8 MiB."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ServeProcess, serving
from tests.helpers import http_get
from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli.bench.loop import HealthPoller
from weightsvc.client import Slice
from weightsvc.errors import ResourceExhausted
from weightsvc.protocol import safetensors as safetensors_module
from weightsvc.protocol.manifest import Manifest

pytestmark = pytest.mark.slow
N = 50_000
LIMIT = ("--max-message-bytes", str(9 << 19))  # 4.5 MiB
def masters(step: int = 1) -> dict[str, np.ndarray]:
    """N small tensors with realistic 60-character names (a DeepSeek-V3-shaped MoE has ~90,000)."""
    return {f"model.layers.{i // 1000:02d}.mlp.experts.{i % 1000:03d}.down_proj.weight_{i:06d}":
            np.full((4, 4), 0.01 * step + i % 7 * 1e-3, np.float32) for i in range(N)}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path, float]]:
    data_dir = tmp_path_factory.mktemp("data")
    server = ServeProcess("--data-dir", str(data_dir), *LIMIT)
    try:
        poller = HealthPoller(server.url)
        with LearnerClient(server.target) as learner:
            learner.push(1, masters(1), model="moe", rounding="sr-sticky")  # (unchanged masters: unchanged bits)
        yield server, data_dir, poller.worst()
    finally:
        server.stop()


def test_a_push_of_50k_tensors_keeps_the_server_answering(big: tuple[ServeProcess, Path, float]) -> None:
    server, _, worst = big
    assert worst < 0.5, f"/healthz took {worst:.2f} s during the push"
    assert InferenceClient(server.target).versions("moe")[0].tensor_count == N


def test_manifests_and_pulls_of_50k_tensors_on_both_transports(big: tuple[ServeProcess, Path, float]) -> None:
    server, _, _ = big
    with InferenceClient(server.target) as grpc_client, InferenceClient(server.url) as http_client:
        manifest = grpc_client.manifest("moe", 1)  # 5.3 MB of manifest: in pieces
        assert len(manifest.tensors) == N and manifest == http_client.manifest("moe", 1)
        # Streamed in slices over HTTP, with its length (not chunked): a client knows how much comes.
        status, headers, body = http_get(server.url, "/v1/models/moe/versions/1/manifest")
        assert status == 200 and int(headers["content-length"]) == len(body) > 1 << 20
        assert "transfer-encoding" not in headers and Manifest.from_dict(json.loads(body)) == manifest
        whole = grpc_client.pull("moe", 1)
        assert len(whole) == N and equal(whole, http_client.pull("moe", 1))
        names = sorted(whole)[:1000]
        sliced = http_client.pull("moe", 1, select={n: Slice(0, 1, 3) for n in names})
        assert all(torch.equal(sliced[n], whole[n][1:3]) for n in names)


def test_delta_restart_and_relay_of_50k_tensors(big: tuple[ServeProcess, Path, float], tmp_path: Path) -> None:
    server, data_dir, _ = big
    state = masters(1)
    for name in list(state)[::1000]:  # 50 tensors change
        state[name] = state[name] + 1
    with LearnerClient(server.target) as learner:
        learner.push(2, state, model="moe", rounding="sr-sticky")
    expected = InferenceClient(server.target).pull("moe", 2)
    for target in (server.target, server.url):
        with InferenceClient(target) as client:
            client.pull("moe", 1)
            assert equal(client.pull("moe", 2, base=1), expected)
            assert client.last_pull_bytes < 10 * N  # the changes (and 9 bytes a tensor), not 32 bytes a tensor
    relay = ServeProcess("--relay-from", server.target, *LIMIT)
    try:
        with InferenceClient(relay.target) as client:
            next(info for info in client.watch("moe") if info.version == 2)
            assert equal(client.pull("moe", 2), expected)
    finally:
        relay.stop()
    server.stop()
    restarted = ServeProcess("--data-dir", str(data_dir), *LIMIT)
    try:
        assert [v.version for v in InferenceClient(restarted.target).versions("moe")] == [1, 2]
        assert equal(InferenceClient(restarted.url).pull("moe", 2), expected)
    finally:
        restarted.stop()


def test_a_version_whose_file_header_would_be_too_big_is_refused_before_it_commits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: str
) -> None:
    monkeypatch.setattr(safetensors_module, "MAX_HEADER_BYTES", 20_000)
    with serving(data_dir=tmp_path) as srv, LearnerClient(srv.grpc_target) as learner:
        certain = {f"{'w' * 200}.{i}": np.zeros(4, np.float32) for i in range(50)}  # 50 x 550 > 20,000 at once
        with pytest.raises(ResourceExhausted, match=r"header would hold \d+ bytes.*more than the 20000"):
            learner.push(1, certain, model=model)
        likely = {f"{'w' * 100}.{i}": np.zeros(4, np.float32) for i in range(50)}  # found out at commit
        with pytest.raises(ResourceExhausted, match=r"header would hold \d+ bytes.*more than the 20000"):
            learner.push(1, likely, model=model)
        assert learner.push(1, {"w": np.zeros(4, np.float32)}, model=model).version == 1
        assert [p.name for p in (tmp_path / "models" / model).iterdir() if p.suffix == ".safetensors"] == [
            f"{1:020d}.safetensors"
        ]
