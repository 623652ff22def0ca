"""Every bad input gets its status code and a message naming what was wrong; nothing half-visible."""

from __future__ import annotations

import http.client
import json
import math
import threading
import urllib.parse
from collections.abc import Iterator

import grpc
import pytest
import torch

from tests.conftest import make_masters, serving, start_server
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    WeightsvcError,
)
from weightsvc.server.server import BackgroundServer
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc


def raw_push(target: str, messages: list[pb.PushRequest]) -> grpc.RpcError:
    """Send a hand-made Push stream; returns the error it must end with."""
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(target, options=options) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.WeightServiceStub(channel).Push(iter(messages))
    return info.value  # type: ignore[return-value]


def header(model: str, step: int = 1, tensors: list[tuple[str, list[int], str]] | None = None) -> pb.PushRequest:
    specs = [pb.TensorSpec(name=n, shape=s, dtype=d) for n, s, d in (tensors or [("w", [4], "F32")])]
    return pb.PushRequest(header=pb.PushHeader(model=model, step=step, tensors=specs))


def chunk(tensor: str, data: bytes, offset: int = 0) -> pb.PushRequest:
    return pb.PushRequest(chunk=pb.Chunk(tensor=tensor, offset=offset, data=data))


COMMIT = pb.PushRequest(commit=pb.PushCommit())
FOUR_FLOATS = torch.arange(4, dtype=torch.float32).numpy().tobytes()


def assert_nothing_visible(server: BackgroundServer, model: str) -> None:
    with pytest.raises(NotFound, match=f"unknown model '{model}'"):
        InferenceClient(server.grpc_target).versions(model)
    server.call(server.service.wait_pushes(0))
    assert server.service.metrics.staged_bytes._value.get() == 0


def http_error(url: str, path: str) -> tuple[int, dict[str, str]]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    return resp.status, body["error"]


# ---- unknown model or version ---------------------------------------------------------------


def test_unknown_model_and_version(server: BackgroundServer, learner: LearnerClient, model: str) -> None:
    for target in (server.grpc_target, server.http_url):
        client = InferenceClient(target)
        with pytest.raises(NotFound, match=f"NOT_FOUND: unknown model '{model}'"):
            client.pull(model)
    learner.push(1, make_masters(), model=model)
    with pytest.raises(NotFound, match=rf"model '{model}' has no version 2 \(retained: 1\)"):
        InferenceClient(server.grpc_target).pull(model, 2)
    status, err = http_error(server.http_url, f"/v1/models/{model}/versions/2/manifest")
    assert status == 404 and err["code"] == "NOT_FOUND" and "has no version 2" in err["message"]
    status, err = http_error(server.http_url, f"/v1/models/{model}/versions/two/safetensors")
    assert status == 400 and "'two' is neither a version number nor 'latest'" in err["message"]
    status, err = http_error(server.http_url, "/v2/nothing")
    assert status == 404 and err["message"] == "no route GET /v2/nothing"


# ---- versions -------------------------------------------------------------------------------


def test_step_not_above_latest(pusher: LearnerClient, model: str) -> None:
    masters = make_masters()
    pusher.push(5, masters, model=model)
    pusher.push(6, masters, model=model)
    with pytest.raises(FailedPrecondition, match=f"model '{model}': step 4 is not above the latest version 6"):
        pusher.push(4, masters, model=model)


def test_steps_are_those_every_version_number_can_be_asked_for_by(
    learner: LearnerClient, puller: InferenceClient, model: str
) -> None:
    """The last valid step commits and is pulled by its number; above it, and below 0, the push is
    refused before anything is staged (a model at 2**63 - 1 could never take another push)."""
    from weightsvc.protocol.refs import MAX_STEP

    masters = {"w": torch.randn(4)}
    for step in (MAX_STEP + 1, 2**63 - 1, -1):
        with pytest.raises(InvalidArgument, match=rf"model '{model}' step {step}: step must be in \[0, {MAX_STEP}\]"):
            learner.push(step, masters, model=model)
    with pytest.raises(NotFound):  # nothing was committed
        puller.versions(model)
    assert learner.push(MAX_STEP, masters, model=model).version == MAX_STEP
    assert puller.manifest(model, MAX_STEP).version == MAX_STEP
    assert puller.pull(model, str(MAX_STEP))["w"].shape == (4,)


def test_same_step_with_different_content(pusher: LearnerClient, puller: InferenceClient, model: str) -> None:
    pusher.push(5, make_masters(seed=1), model=model)
    before = puller.manifest(model, 5)
    with pytest.raises(AlreadyExists, match=f"model '{model}' version 5 is already committed with different content"):
        pusher.push(5, make_masters(seed=2), model=model)
    assert puller.manifest(model, 5) == before  # the committed version is untouched


# ---- malformed streams ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, messages, message",
    [
        (
            "short",
            lambda m: [header(m), chunk("w", FOUR_FLOATS[:8]), COMMIT],
            "commit of an incomplete push: 'w' has 8 of 16 bytes",
        ),
        (
            "long",
            lambda m: [header(m), chunk("w", FOUR_FLOATS + FOUR_FLOATS), COMMIT],
            "tensor 'w': 32 bytes received, more than its declared shape [4] of F32 holds (16 bytes)",
        ),
        (
            "unknown dtype",
            lambda m: [header(m, tensors=[("w", [4], "F99")]), COMMIT],
            "tensor 'w' has unknown dtype 'F99'",
        ),
        (
            "not a master dtype",
            lambda m: [header(m, tensors=[("w", [4], "BF16")]), COMMIT],
            "tensor 'w' is BF16; masters are pushed as F32",
        ),
        (
            "duplicate",
            lambda m: [header(m, tensors=[("w", [4], "F32"), ("w", [4], "F32")]), COMMIT],
            "tensor 'w' is declared twice",
        ),
        ("undeclared", lambda m: [header(m), chunk("v", FOUR_FLOATS), COMMIT], "chunk for undeclared tensor 'v'"),
        (
            "gap",
            lambda m: [header(m), chunk("w", FOUR_FLOATS[:8], offset=8), COMMIT],
            "tensor 'w': chunk at byte offset 8, expected 0",
        ),
        (
            "split element",
            lambda m: [header(m), chunk("w", FOUR_FLOATS[:6]), COMMIT],
            "a chunk of 6 bytes splits an element",
        ),
        ("no header", lambda m: [chunk("w", FOUR_FLOATS), COMMIT], "a push must start with its header"),
        ("two headers", lambda m: [header(m), header(m), COMMIT], "a second header"),
        (
            "no tensors",
            lambda m: [pb.PushRequest(header=pb.PushHeader(model=m, step=1)), COMMIT],
            "the push declares no tensors",
        ),
        ("bad model name", lambda m: [header("../etc"), COMMIT], "model name '../etc' is invalid"),
        (
            "negative dim",
            lambda m: [header(m, tensors=[("w", [-1, 4], "F32")]), COMMIT],
            "tensor 'w' has a negative dimension",
        ),
        ("empty message", lambda m: [header(m), pb.PushRequest(), COMMIT], "empty push message"),
    ],
)
def test_malformed_push_is_invalid_argument(
    server: BackgroundServer, model: str, case: str, messages: object, message: str
) -> None:
    err = raw_push(server.grpc_target, messages(model))  # type: ignore[operator]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert message in err.details()
    assert_nothing_visible(server, model)


def test_stream_without_commit_leaves_nothing(server: BackgroundServer, model: str) -> None:
    err = raw_push(server.grpc_target, [header(model), chunk("w", FOUR_FLOATS)])
    assert err.code() == grpc.StatusCode.ABORTED
    assert "the stream ended without a commit" in err.details()
    assert_nothing_visible(server, model)


@pytest.mark.parametrize("bad, count", [(math.nan, 3), (math.inf, 1), (-math.inf, 2)])
def test_nonfinite_master_is_rejected_with_names_and_counts(
    server: BackgroundServer, learner: LearnerClient, model: str, bad: float, count: int
) -> None:
    masters = make_masters()
    masters["layers.0.mlp.up.weight"].view(-1)[:count] = bad
    rejected = server.service.metrics.pushes_rejected.labels("nonfinite")
    before = rejected._value.get()
    with pytest.raises(InvalidArgument, match=rf"'layers.0.mlp.up.weight' \({count} NaN/Inf\)"):
        learner.push(1, masters, model=model)
    assert_nothing_visible(server, model)
    assert rejected._value.get() == before + 1


def test_message_over_the_limit(server: BackgroundServer, model: str) -> None:
    too_big = b"\0" * (server.service.settings.max_message_bytes + 4)
    err = raw_push(
        server.grpc_target, [header(model, tensors=[("w", [len(too_big) // 4], "F32")]), chunk("w", too_big), COMMIT]
    )
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.details()
    assert_nothing_visible(server, model)
    with pytest.raises(ResourceExhausted):
        LearnerClient(server.grpc_target, chunk_bytes=len(too_big)).push(
            1, {"w": torch.zeros(len(too_big) // 4)}, model=model
        )


def test_client_that_disconnects_mid_push_leaves_nothing(server: BackgroundServer, model: str) -> None:
    """The learner dies after sending part of a push: nothing visible, staging memory released."""
    sent = threading.Event()
    never = threading.Event()

    def stream() -> Iterator[pb.PushRequest]:
        yield header(model, tensors=[("w", [1 << 20], "F32")])
        yield chunk("w", b"\0" * (1 << 20))
        sent.set()
        never.wait(60)  # the learner hangs until its channel is torn down

    channel = grpc.insecure_channel(server.grpc_target)
    call = pb_grpc.WeightServiceStub(channel).Push.future(stream())
    assert sent.wait(30)
    server.call(server.service.wait_pushes(1))  # the server holds the staged push
    assert server.service.metrics.staged_bytes._value.get() > 0
    call.cancel()
    channel.close()
    never.set()
    assert_nothing_visible(server, model)


def test_rejected_pushes_are_counted_by_reason(server: BackgroundServer, model: str) -> None:
    counter = server.service.metrics.pushes_rejected
    before = counter.labels("bad_chunk")._value.get()
    raw_push(server.grpc_target, [header(model), chunk("nope", FOUR_FLOATS), COMMIT])
    assert counter.labels("bad_chunk")._value.get() == before + 1


def test_client_errors_are_domain_errors(server: BackgroundServer) -> None:
    with pytest.raises(TypeError, match=r"tensor 'ids' is torch\.int64"):
        LearnerClient(server.grpc_target).push(1, {"ids": torch.arange(3)})
    with pytest.raises(WeightsvcError, match="UNAVAILABLE"):
        InferenceClient("127.0.0.1:1", timeout=2).pull()


def test_stalled_push_times_out_and_leaves_nothing(model: str) -> None:
    srv = start_server(push_idle_timeout_s=0.3)
    release = threading.Event()

    def stream() -> Iterator[pb.PushRequest]:
        yield header(model)
        release.wait(60)  # a learner that stops sending without closing its stream

    try:
        with grpc.insecure_channel(srv.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
            pb_grpc.WeightServiceStub(channel).Push(stream())
        release.set()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "push stalled: nothing received for 0.3 s" in info.value.details()
        assert_nothing_visible(srv, model)
    finally:
        release.set()
        srv.__exit__(None, None, None)


def test_oversized_and_reserved_headers(server: BackgroundServer, model: str) -> None:
    err = raw_push(server.grpc_target, [header(model, tensors=[("w", [1 << 62, 1 << 62], "F32")]), COMMIT])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tensor 'w' of shape [4611686018427387904, 4611686018427387904] holds" in err.details()
    assert "bytes a tensor may have (--max-tensor-bytes)" in err.details()
    two = [("a", [1 << 20, 1 << 10], "F32"), ("b", [1 << 20, 1 << 10], "F32")]  # 4 GiB each, 8 GiB together
    with serving(max_version_bytes=6 << 30, max_tensor_bytes=5 << 30) as srv:
        err = raw_push(srv.grpc_target, [header(model, tensors=two), COMMIT])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the masters declared up to tensor 'b' already hold 8589934592 bytes, more than the" in err.details()
    assert "(--max-version-bytes)" in err.details()
    err = raw_push(server.grpc_target, [header(model, tensors=[("__metadata__", [4], "F32")]), COMMIT])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'__metadata__' is reserved" in err.details()
    assert_nothing_visible(server, model)


def test_staging_budget_refuses_pushes_beyond_it(model: str) -> None:
    with serving(max_staged_bytes=1000) as srv:
        err = raw_push(srv.grpc_target, [header(model, tensors=[("w", [1000], "F32")]), COMMIT])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "would exceed the staging budget of 1000 bytes" in err.details()
        LearnerClient(srv.grpc_target).push(1, {"w": torch.zeros(100)}, model=model)  # 200 bytes fit


@pytest.mark.parametrize("settings", [{"rounding": "ef"}, {"format": "fp8_e4m3"}], ids=["ef", "fp8"])
def test_the_staging_budget_counts_ef_residuals_and_gathered_fp8_masters(model: str, settings: dict[str, str]) -> None:
    """A 256 x 256 tensor serves in at most 128 KiB, within a 200 KiB budget; with ef its new fp32
    residual, in fp8 its master gathered whole for the scales, add 4 bytes an element: 384 KiB, and
    the push is refused before it stages anything."""
    with serving(max_staged_bytes=200 << 10, **settings) as srv, LearnerClient(srv.grpc_target) as learner:
        with pytest.raises(ResourceExhausted, match=r"pushes in progress hold 0 bytes; 393216 more \(served bytes, "
                                                    r"ef residuals and fp8 masters gathered for their scales\) would "
                                                    r"exceed the staging budget of 204800 bytes"):
            learner.push(1, {"layers.0.mlp.weight": torch.randn(256, 256)}, model=model)
        assert_nothing_visible(srv, model)
        assert learner.push(1, {"layers.0.mlp.weight": torch.randn(128, 256)}, model=model).created  # 192 KiB


@pytest.mark.parametrize("version", ["\u00b2", "9" * 5000, "-1", "1.5"])
def test_odd_version_strings_are_invalid_argument(
    server: BackgroundServer, learner: LearnerClient, model: str, version: str
) -> None:
    learner.push(1, make_masters(), model=model)
    status, err = http_error(server.http_url, f"/v1/models/{model}/versions/{urllib.parse.quote(version)}/manifest")
    assert status == 400 and err["code"] == "INVALID_ARGUMENT"
    with pytest.raises(InvalidArgument, match="neither a version number nor 'latest'"):
        InferenceClient(server.grpc_target).manifest(model, version)


def test_unknown_model_clients_route_is_404(server: BackgroundServer, model: str) -> None:
    status, err = http_error(server.http_url, f"/v1/models/{model}/clients")
    assert status == 404 and f"unknown model '{model}'" in err["message"]


def test_aborted_pushes_keep_no_more_memory_than_the_next_push_can_use(model: str) -> None:
    """An aborted push leaves its buffer for reuse only where the next push can use it: at the size
    of a version retained (the retry of a model's next step), within the staging budget; and a push
    that needs that memory has it freed rather than refused."""
    mib = 1 << 20
    with serving(max_staged_bytes=48 * mib) as srv:
        pool = srv.service.index.pool
        for i, size in enumerate((16, 18, 20, 22)):  # served MiB: bf16 halves the fp32 masters
            n = size * mib // 2
            error = raw_push(srv.grpc_target, [header(model, 1 + i, [("w", [n], "F32")]), chunk("w", FOUR_FLOATS)])
            assert error.code() == grpc.StatusCode.ABORTED, error
            srv.call(srv.service.wait_pushes(0))
            assert pool.free_bytes == 0, (size, pool.free_bytes)  # no version of that size: none kept
        with LearnerClient(srv.grpc_target) as learner:
            learner.push(5, {"w": torch.randn(16 * mib // 2)}, model=model)
            retry = [header(model, 6, [("w", [16 * mib // 2], "F32")]), chunk("w", FOUR_FLOATS)]
            error = raw_push(srv.grpc_target, retry)
            assert error.code() == grpc.StatusCode.ABORTED, error
            srv.call(srv.service.wait_pushes(0))
            assert pool.free_bytes == 16 * mib  # the size of version 5: the retry of step 6 takes it
            assert srv.service.metrics.staged_bytes._value.get() == 0
            # 40 MiB served, and the 16 kept, pass the 48 MiB budget: the kept buffer is freed, not the push refused
            assert learner.push(9, {"w": torch.randn(40 * mib // 2)}, model=model).created


def test_a_push_of_one_model_more_than_max_models_is_refused(model: str) -> None:
    with serving(max_models=2) as srv, LearnerClient(srv.grpc_target) as learner:
        masters = {"w": torch.randn(4)}
        learner.push(1, masters, model=f"{model}-a")
        learner.push(1, masters, model=f"{model}-b")
        with pytest.raises(ResourceExhausted, match=rf"model '{model}-c' step 1: this server holds or is receiving "
                                                    r"2 models, the most it takes \(--max-models 2\)"):
            learner.push(1, masters, model=f"{model}-c")
        assert learner.push(2, masters, model=f"{model}-a").created  # the models it holds go on
        with pytest.raises(NotFound):
            InferenceClient(srv.grpc_target).versions(f"{model}-c")


def test_a_push_that_trickles_is_dropped_at_its_deadline_and_lets_go_of_its_staging(model: str) -> None:
    """Each chunk comes within the idle timeout, but the bytes come far below the minimum rate: the
    push ends at its deadline (twice the idle timeout plus its bytes at that rate), and its staging goes."""
    import time

    with serving(push_idle_timeout_s=1.0, push_min_bytes_per_s=64 << 10) as srv:  # 16 KiB: 2.25 s in all

        def trickle() -> Iterator[pb.PushRequest]:
            yield header(model, 1, [("w", [4096], "F32")])
            for i in range(100):
                yield chunk("w", FOUR_FLOATS[:4], offset=4 * i)
                time.sleep(0.25)  # the slow client under test

        start = time.monotonic()
        with grpc.insecure_channel(srv.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
            pb_grpc.WeightServiceStub(channel).Push(trickle())
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
        assert f"model '{model}' step 1: push too slow: not done 2 s after its staging opened" in info.value.details()
        assert time.monotonic() - start < 5
        assert_nothing_visible(srv, model)
