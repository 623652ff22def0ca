"""Push fp32 masters and pull the served copy back, over real gRPC and HTTP servers on port 0."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load

from tests.conftest import make_masters, serving, target
from tests.helpers import assert_served, http_get
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import _grpc as client_grpc
from weightsvc.rounding import fair_cast
from weightsvc.server.server import BackgroundServer


def test_small_chunks_give_the_same_version(server: BackgroundServer, model: str, push_transport: str) -> None:
    masters = make_masters(seed=3)
    to = target(server, push_transport)
    with LearnerClient(to, chunk_bytes=4096) as small, LearnerClient(to) as big:
        small.push(1, masters, model=model + "-a")
        big.push(1, masters, model=model + "-b")
    puller = InferenceClient(server.grpc_target)
    a, b = puller.manifest(model + "-a", 1), puller.manifest(model + "-b", 1)
    assert [t.checksum for t in a.tensors] == [t.checksum for t in b.tensors]
    assert a.master_digest == b.master_digest


def test_idempotent_push_returns_the_committed_version(
    pusher: LearnerClient, puller: InferenceClient, model: str
) -> None:
    masters = make_masters()
    first = pusher.push(3, masters, model=model)
    again = pusher.push(3, masters, model=model)
    assert first.created and not again.created
    assert again.committed_unix == first.committed_unix
    assert [v.version for v in puller.versions(model)] == [3]


def test_http_json_routes(server: BackgroundServer, learner: LearnerClient, model: str) -> None:
    learner.push(4, make_masters(), model=model)
    status, headers, body = http_get(server.http_url, f"/v1/models/{model}/versions")
    assert status == 200 and headers["content-type"] == "application/json"
    versions = json.loads(body)["versions"]
    assert [v["version"] for v in versions] == [4]
    status, _, body = http_get(server.http_url, f"/v1/models/{model}/versions/latest/manifest")
    assert status == 200 and json.loads(body)["version"] == 4
    status, _, body = http_get(server.http_url, "/v1/models")
    assert any(m["model"] == model for m in json.loads(body)["models"])
    assert http_get(server.http_url, "/healthz")[0] == 200
    assert http_get(server.http_url, "/readyz")[0] == 200


def test_safetensors_download_is_valid_and_supports_ranges(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    masters = make_masters()
    learner.push(8, masters, model=model)
    path = f"/v1/models/{model}/versions/8/safetensors"
    status, headers, whole = http_get(server.http_url, path)
    assert status == 200 and headers["accept-ranges"] == "bytes"
    assert headers["x-weightsvc-version"] == "8" and int(headers["content-length"]) == len(whole)
    assert_served(load(whole), masters, 8)

    status, headers, part = http_get(server.http_url, path, {"Range": "bytes=100-1099"})
    assert status == 206 and part == whole[100:1100]
    assert headers["content-range"] == f"bytes 100-1099/{len(whole)}"
    status, _, tail = http_get(server.http_url, path, {"Range": "bytes=-300"})
    assert status == 206 and tail == whole[-300:]
    status, _, rest = http_get(server.http_url, path, {"Range": f"bytes={len(whole) - 5}-"})
    assert status == 206 and rest == whole[-5:]
    status, headers, body = http_get(server.http_url, path, {"Range": f"bytes={len(whole)}-"})
    assert status == 416 and headers["content-range"] == f"bytes */{len(whole)}"
    assert b"outside the" in body
    # An invalid range is ignored (RFC 9110): the whole file.
    assert http_get(server.http_url, path, {"Range": "bytes=5-3"})[:3:2] == (200, whole)
    # A resume whose If-Range no longer matches gets the whole current file, never a splice.
    etag = http_get(server.http_url, path)[1]["etag"]
    assert http_get(server.http_url, path, {"Range": "bytes=10-", "If-Range": etag})[0] == 206
    assert http_get(server.http_url, path, {"Range": "bytes=10-", "If-Range": '"stale"'})[:3:2] == (200, whole)
    # HEAD: the headers of GET, no body.
    u = urllib.parse.urlsplit(server.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("HEAD", path)
    resp = conn.getresponse()
    assert resp.status == 200 and int(resp.getheader("content-length")) == len(whole) and resp.read() == b""
    conn.close()


def test_grpc_and_http_files_are_identical(
    server: BackgroundServer, learner: LearnerClient, model: str, tmp_path: Path
) -> None:
    out = tmp_path
    learner.push(2, make_masters(), model=model)
    InferenceClient(server.grpc_target).pull_file(out / "g.safetensors", model)
    InferenceClient(server.http_url).pull_file(out / "h.safetensors", model)
    assert (out / "g.safetensors").read_bytes() == (out / "h.safetensors").read_bytes()


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_retention_keeps_the_last_k_and_a_pull_in_progress_finishes(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The puller's gRPC receive window stays at its first size: with bandwidth probing, gRPC grows it
    # while the client's thread waits for the GIL, and on a busy machine the whole version could then
    # arrive before the client takes its first piece (the pull would be over, not in progress). Over
    # HTTP the kernel's receive buffer grows only as fast as the client reads.
    monkeypatch.setattr(client_grpc, "CHANNEL_OPTIONS", (*client_grpc.CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0)))
    with serving(retain=2) as srv:
        # 32 MiB served: far more than the transport windows, so the pull is still in flight.
        masters = {"w": torch.randn(4096, 4096) * 0.02}
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, masters, model="r")
        # Start pulling version 1, hold the stream after its first piece, then evict version 1 and
        # push more versions: recycled buffers must never be the one being read.
        puller = InferenceClient(srv.grpc_target if transport == "grpc" else srv.http_url)
        first_piece = threading.Event()
        resume = threading.Event()

        def progress(_n: int) -> None:
            if not first_piece.is_set():
                first_piece.set()
                resume.wait(30)

        result: dict[str, object] = {}
        t = threading.Thread(target=lambda: result.update(w=puller.pull("r", 1, progress=progress)))
        t.start()
        assert first_piece.wait(30)
        assert srv.service.metrics.pulls_in_flight.labels(transport)._value.get() == 1
        for step in (2, 3, 4, 5):
            learner.push(step, masters, model="r")
        assert [v.version for v in puller.versions("r")] == [4, 5]
        resume.set()
        t.join(30)
        assert_served(result["w"], masters, 1)  # type: ignore[arg-type]


def test_evicted_buffers_are_reused_by_the_next_push() -> None:
    with serving(retain=1) as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, make_masters(seed=1))
        first = srv.service.index.get("default", 1).data.obj
        learner.push(2, make_masters(seed=2))  # evicts 1: its buffer is free
        assert srv.service.index.pool.free_bytes > 0
        learner.push(3, make_masters(seed=3))
        assert srv.service.index.get("default", 3).data.obj is first
        assert_served(InferenceClient(srv.grpc_target).pull(), make_masters(seed=3), 3)
        # HTTP's writer threads are done with the buffer once the pull ends (the kernel copied the
        # bytes): a version pulled over HTTP is recycled as well.
        assert_served(InferenceClient(srv.http_url).pull(), make_masters(seed=3), 3)
        learner.push(4, make_masters(seed=4))  # takes version 2's buffer, evicts version 3
        assert srv.service.index.pool.free_bytes == len(first)


def test_grpc_health_service(server: BackgroundServer) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "weightsvc.v1.WeightService"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_after_push_and_pull(server: BackgroundServer, learner: LearnerClient, model: str) -> None:
    masters = make_masters()
    learner.push(6, masters, model=model)
    InferenceClient(server.grpc_target).pull(model)
    InferenceClient(server.http_url).pull(model)
    # A pull's bytes are counted as the server sends them, and its client may have them all first: the
    # counts are read once the server has ended both pulls.
    server.call(server.service.wait_for(lambda: server.service.pulls.in_flight == 0))
    status, headers, body = http_get(server.http_url, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    master_bytes = sum(t.numel() * 4 for t in masters.values())
    served_bytes = InferenceClient(server.grpc_target).manifest(model).data_bytes
    assert samples[("weightsvc_latest_version", (("model", model),))] == 6
    assert samples[("weightsvc_push_bytes_total", (("model", model),))] == master_bytes
    for transport in ("grpc", "http"):
        pulled = samples[("weightsvc_pull_bytes_total", (("model", model), ("transport", transport)))]
        assert pulled >= served_bytes
    assert samples[("weightsvc_export_seconds_count", (("format", "bf16"), ("rounding", "sr")))] >= 1
    assert samples[("weightsvc_retained_versions", (("model", model),))] == 1


@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_serve_rounding_and_seed(rounding: str) -> None:
    with serving(rounding=rounding, seed=42) as srv:
        masters = make_masters()
        LearnerClient(srv.grpc_target).push(9, masters)
        pulled = InferenceClient(srv.grpc_target).pull()
        assert_served(pulled, masters, 9, rounding=rounding, seed=42)
        manifest = InferenceClient(srv.http_url).manifest()
        assert (manifest.rounding, manifest.seed) == (rounding, 42)


def test_iter_weights_loads_a_torch_model(server: BackgroundServer, model: str) -> None:
    torch.manual_seed(0)
    learner_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    LearnerClient(server.grpc_target).push(3, learner_model.state_dict(), model=model)
    served_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    served_model = served_model.to(torch.bfloat16)
    params = dict(served_model.named_parameters())
    for name, tensor in InferenceClient(server.grpc_target).iter_weights(model):  # a load_weights loop
        params[name].data.copy_(tensor)
    for name, master in learner_model.state_dict().items():
        expected = fair_cast(master, rounding="sr", version=3, name=name)
        assert torch.equal(params[name].data.view(torch.int16), expected.view(torch.int16))
