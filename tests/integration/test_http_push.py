"""Pushes over HTTP: the framed PushRequest body (POST .../push) and a safetensors file (PUT, curl -T)."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import make_masters, serving
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import Shard
from weightsvc.errors import ResourceExhausted
from weightsvc.protocol.wire import encode_chunk
from weightsvc.server.server import BackgroundServer
from weightsvc.v1 import weightsvc_pb2 as pb

TOKENS = {"pull": "pull-secret-1", "push": "push-secret-2"}


def frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def header(model: str, step: int, numel: int) -> bytes:
    spec = pb.TensorSpec(name="w", shape=[numel], dtype="F32")
    return frame(pb.PushRequest(header=pb.PushHeader(model=model, step=step, tensors=[spec])).SerializeToString())


def post(srv: BackgroundServer, path: str, body: bytes, token: str | None = None,
         method: str = "POST") -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection("127.0.0.1", int(srv.http_url.rsplit(":", 1)[1]), timeout=30)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def settled(srv: BackgroundServer) -> None:
    """Wait until the server holds no push stream (an aborted one is released in the background)."""
    assert srv.service is not None
    deadline = time.monotonic() + 10
    while srv.service.pushes.streams or srv.service.pushes.sessions:
        assert time.monotonic() < deadline, "the cut push was never released"
        time.sleep(0.01)


def test_a_body_cut_mid_chunk_leaves_nothing_and_the_step_pushes_again(server: BackgroundServer, model: str) -> None:
    data = torch.arange(1 << 16, dtype=torch.float32)
    body = header(model, 5, data.numel()) + frame(encode_chunk("w", 0, data.numpy().view("uint8").data))
    port = int(server.http_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST /v1/models/{model}/push HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body) + 5}\r\n\r\n"
                     .encode() + body[: len(body) // 2])
    settled(server)
    with InferenceClient(server.http_url) as puller:
        assert model not in {m["model"] for m in puller.models()}
    with LearnerClient(server.http_url) as learner:
        info = learner.push(5, {"w": data}, model=model, return_served=True)
    assert info.version == 5 and info.created
    assert info.served is not None and torch.allclose(info.served["w"].float(), data, rtol=1 / 64)


def test_a_body_that_ends_before_the_commit_is_aborted(server: BackgroundServer, model: str) -> None:
    data = torch.ones(1024)
    status, answer = post(server, f"/v1/models/{model}/push",
                          header(model, 2, 1024) + frame(encode_chunk("w", 0, data.numpy().view("uint8").data)))
    assert status == 409 and answer["error"]["code"] == "ABORTED", answer  # type: ignore[index]
    settled(server)
    with InferenceClient(server.http_url) as puller:
        assert model not in {m["model"] for m in puller.models()}


def test_a_frame_over_the_message_limit_is_refused(server: BackgroundServer, model: str) -> None:
    assert server.service is not None
    limit = server.service.settings.max_message_bytes
    body = header(model, 1, 4) + b"\x00" + (limit + 1).to_bytes(4, "big") + b"\x12" * 64
    status, answer = post(server, f"/v1/models/{model}/push", body)
    error = answer["error"]
    assert status == 413 and error["code"] == "RESOURCE_EXHAUSTED" and str(limit) in error["message"], answer  # type: ignore[index]


def test_the_header_must_name_the_model_of_the_route(server: BackgroundServer, model: str) -> None:
    status, answer = post(server, f"/v1/models/{model}/push", header("another", 1, 4))
    assert status == 400 and "'another'" in answer["error"]["message"], answer  # type: ignore[index]


def file_body(header: bytes, data_bytes: int = 16) -> bytes:
    return len(header).to_bytes(8, "little") + header + bytes(data_bytes)


def entry(shape: bytes, offsets: bytes = b"[0, 16]") -> bytes:
    return b'{"w": {"dtype": "F32", "shape": %s, "data_offsets": %s}}' % (shape, offsets)


def framed_push(model: str, after: bytes) -> bytes:
    """A push of one tensor of 4 elements, its chunk sent, then `after`."""
    return header(model, 1, 4) + frame(encode_chunk("w", 0, torch.ones(4).numpy().view("uint8").data)) + after


COMMIT = frame(pb.PushRequest(commit=pb.PushCommit()).SerializeToString())
# Each answered 500 and dropped the keep-alive connection, or was taken for what it is not: a shape of
# [4.7] or ["4"], offsets [0.5, 16.5] or a byte order mark served as [4]; frames after the commit ignored.
BAD_BODIES = [
    ("PUT", lambda m: file_body(b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"), "nests deeper than any"),
    ("PUT", lambda m: file_body(entry(b"[1e400]")), "model {m!r} step 1 tensor 'w': shape [Infinity] is not a "
                                                    "list of integers in [0, 2^64)"),
    ("PUT", lambda m: file_body(entry(b"[4.7]")), "tensor 'w': shape [4.7] is not a list of integers"),
    ("PUT", lambda m: file_body(entry(b'["4"]')), """tensor 'w': shape ["4"] is not a list of integers"""),
    ("PUT", lambda m: file_body(entry(b"[4]", b"[0.5, 16.5]")), "tensor 'w': data_offsets [0.5, 16.5] are not two "
                                                                 "integers"),
    ("PUT", lambda m: file_body(b"\xef\xbb\xbf" + entry(b"[4]")), "a JSON object from its first byte, not start "
                                                                   "with '\\ufeff'"),
    ("PUT", lambda m: file_body(b"", 0), "model {m!r} step 1: the safetensors header cannot be read"),
    ("PUT", lambda m: file_body(entry(b"[4]").replace(b'"w"', b'"\\ud800"')), "model {m!r} step 1: the safetensors "
     "header cannot be read: a string of it holds a lone surrogate '\\ud800'"),  # (500: its name encoded at commit)
    ("POST", lambda m: framed_push(m, b"\0" * 5), "empty push message"),  # a frame of 0 bytes, the body's last
    ("POST", lambda m: framed_push(m, COMMIT + header(m, 2, 4)), "the body goes on past its commit frame (at byte"),
    ("POST", lambda m: framed_push(m, COMMIT + b"x"), "the body goes on past its commit frame"),
]


@pytest.mark.parametrize(("method", "body", "words"), BAD_BODIES, ids=[f"{m}-{i}" for i, (m, _, _) in
                                                                       enumerate(BAD_BODIES)])
def test_a_malformed_push_body_is_refused_and_keeps_its_connection(
    server: BackgroundServer, model: str, method: str, body: Callable[[str], bytes], words: str
) -> None:
    path = f"/v1/models/{model}/push" if method == "POST" else f"/v1/models/{model}/versions/1/safetensors"
    conn = http.client.HTTPConnection("127.0.0.1", int(server.http_url.rsplit(":", 1)[1]), timeout=30)
    try:
        conn.request(method, path, body=body(model))
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        assert (resp.status, answer["error"]["code"]) == (400, "INVALID_ARGUMENT"), answer
        assert words.format(m=model) in answer["error"]["message"], answer
        conn.request("GET", "/healthz")  # on the same connection
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    settled(server)
    with InferenceClient(server.http_url) as puller:
        assert model not in {m["model"] for m in puller.models()}


@pytest.fixture
def curl() -> str:
    path = shutil.which("curl")
    if path is None:
        pytest.skip("curl is not installed")
    return path


def test_curl_upload_of_a_safetensors_file_serves_the_bits_of_a_learner_push(
    server: BackgroundServer, model: str, curl: str, tmp_path: Path
) -> None:
    masters = make_masters(seed=3)
    masters["big"] = torch.randn(700, 1000)  # a tensor over several body pieces and 1 MiB chunks
    path = tmp_path / "model.safetensors"
    save_file(masters, str(path))
    url = f"{server.http_url}/v1/models/{model}-file/versions/7/safetensors?rounding=sr"
    out = subprocess.run([curl, "-sS", "--fail-with-body", "-T", str(path), url], capture_output=True, check=True)
    answer = json.loads(out.stdout)
    assert answer["version"] == 7 and answer["created"] and answer["tensor_count"] == len(masters)
    with LearnerClient(server.grpc_target) as learner:
        pushed = learner.push(7, masters, model=model, rounding="sr", return_served=True).served
    with InferenceClient(server.http_url) as puller:
        uploaded = puller.pull(f"{model}-file", 7)
    assert pushed is not None and uploaded.keys() == pushed.keys()
    for name, t in pushed.items():
        assert torch.equal(uploaded[name].view(torch.int16), t.view(torch.int16)), name


def test_a_file_of_another_dtype_is_refused_naming_the_tensor(
    server: BackgroundServer, model: str, curl: str, tmp_path: Path
) -> None:
    path = tmp_path / "half.safetensors"
    save_file({"a": torch.ones(4), "b.half": torch.ones(4, dtype=torch.bfloat16)}, str(path))
    url = f"{server.http_url}/v1/models/{model}/versions/1/safetensors"
    out = subprocess.run([curl, "-sS", "-w", "%{http_code}", "-T", str(path), url], capture_output=True, check=True)
    body, status = out.stdout[:-3], out.stdout[-3:]
    assert status == b"400" and "'b.half' is BF16" in json.loads(body)["error"]["message"], out.stdout
    with InferenceClient(server.http_url) as puller:
        assert model not in {m["model"] for m in puller.models()}


@pytest.fixture(scope="module")
def authed() -> Iterator[BackgroundServer]:
    with serving(**{f"{role}_tokens": token for role, token in TOKENS.items()}) as srv:
        yield srv


def test_both_push_routes_need_role_push(authed: BackgroundServer, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(8)}, str(path))
    file = path.read_bytes()
    with LearnerClient(authed.http_url, token=TOKENS["push"]) as learner:
        framed = b"".join(b"".join((b"\x00", sum(map(len, m)).to_bytes(4, "big"), *m))
                          for m in learner._messages(pb.PushHeader(model="a", step=1), {"w": torch.ones(8)}, {},
                                                     None, []))
    for path_, body, method in (("/v1/models/a/push", framed, "POST"),
                                ("/v1/models/a/versions/2/safetensors", file, "PUT")):
        status, answer = post(authed, path_, body, TOKENS["pull"], method)
        assert status == 403 and answer["error"]["code"] == "PERMISSION_DENIED", answer  # type: ignore[index]
        status, answer = post(authed, path_, body, TOKENS["push"], method)
        assert status == 200 and answer["created"], answer


def test_the_learner_reads_a_refusal_that_comes_while_it_sends(model: str) -> None:
    with serving(max_message_bytes=64 << 10) as srv, LearnerClient(srv.http_url, chunk_bytes=1 << 20) as learner:
        with pytest.raises(ResourceExhausted, match=r"more than the 65536 this server takes \(--max-message-bytes\)"):
            learner.push(1, {"w": torch.zeros(4 << 20)}, model=model)  # 16 MiB in frames of 1 MiB
        assert learner.push(1, {"w": torch.zeros(4 << 10)}, model=model).created  # chunks under the limit


def test_a_body_that_stalls_is_given_up_after_the_idle_timeout(model: str) -> None:
    with serving(push_idle_timeout_s=0.5) as srv:
        port = int(srv.http_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(f"POST /v1/models/{model}/push HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         .encode())
            first = header(model, 1, 4)
            sock.sendall(b"%x\r\n%s\r\n" % (len(first), first))
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            answer = resp.read()
        assert resp.status == 504 and b"push stalled: nothing received for 0.5 s" in answer, answer
        with InferenceClient(srv.http_url) as puller:
            assert model not in {m["model"] for m in puller.models()}


def test_a_rank_that_waits_for_a_late_rank_keeps_its_connection(model: str) -> None:
    """The server stops reading a rank's body until every rank has joined: that wait is not the client's
    slowness, and the connection's body deadline does not count it."""
    state = {"w": torch.randn(512, 1024)}  # 2 MiB: more than the server buffers before it stops reading
    with serving(connect_timeout_s=0.5) as srv, LearnerClient(srv.http_url) as first, \
            LearnerClient(srv.http_url) as late:
        part = {"w": Shard(state["w"].reshape(-1)[: 1 << 18], 0, (512, 1024))}
        rest = {"w": Shard(state["w"].reshape(-1)[1 << 18 :], 1 << 18, (512, 1024))}
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(first.push, 1, part, model=model, rank=0, world_size=2)
            service = srv.service
            assert service is not None
            srv.call(service.wait_for(lambda: (model, 1) in service.pushes.joining))  # rank 0 waits for rank 1
            time.sleep(1.5)  # three of the connection's deadlines: the late rank is late
            assert late.push(1, rest, model=model, rank=1, world_size=2).created
            assert waiting.result().version == 1
