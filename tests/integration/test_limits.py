"""Limits: sizes per version and tensor, streams at once, a memory high-water mark, and pulls whose
client stops reading. Each answers a clear RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED, frees what it
held, and leaves the server serving."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import make_masters, serving, target
from tests.helpers import closed_by_server
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import ResourceExhausted
from weightsvc.server.server import BackgroundServer
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc


def test_size_limits_name_the_limit_and_the_tensor(model: str, push_transport: str) -> None:
    with serving(max_tensors=3, max_tensor_bytes=64 << 10) as srv, \
            LearnerClient(target(srv, push_transport)) as learner:
        with pytest.raises(ResourceExhausted, match=r"6 tensors, more than the 3 a version may have \(--max-tensors\)"):
            learner.push(1, make_masters(), model=model)
        big = {"small": torch.zeros(8), "layers.0.mlp.up.weight": torch.zeros(300, 64)}
        too_big = r"tensor 'layers.0.mlp.up.weight' of shape \[300, 64\] holds 76800 bytes, more than the 65536"
        with pytest.raises(ResourceExhausted, match=too_big):
            learner.push(1, big, model=model)
        assert learner.push(1, {"small": torch.zeros(8)}, model=model).version == 1


def _open_push(target: str, model: str, release: threading.Event) -> tuple[grpc.Channel, grpc.Future]:
    """A push stream that sent its header and then waits for `release`: it holds a push slot."""
    channel = grpc.insecure_channel(target)
    spec = pb.TensorSpec(name="w", shape=[4], dtype="F32")
    header = pb.PushRequest(header=pb.PushHeader(model=model, step=1, tensors=[spec]))

    def requests() -> Iterator[pb.PushRequest]:
        yield header
        release.wait()

    call = pb_grpc.WeightServiceStub(channel).Push.future(requests())
    return channel, call


def test_streams_beyond_max_pushes_are_refused_and_the_slot_comes_back(model: str, push_transport: str) -> None:
    with serving(max_pushes=1) as srv:
        release = threading.Event()
        channel, call = _open_push(srv.grpc_target, model, release)
        to = target(srv, push_transport)
        try:
            srv.call(srv.service.wait_pushes(1))  # the first push is staged and holds the only slot
            with pytest.raises(ResourceExhausted, match=r"1 push streams in progress.*\(--max-pushes 1\); retry later"):
                LearnerClient(to).push(2, make_masters(), model=model + "-2")
        finally:
            call.cancel()
            release.set()
            channel.close()
        srv.call(srv.service.wait_pushes(0))
        assert LearnerClient(to).push(2, make_masters(), model=model + "-2").version == 2


def test_memory_high_water_mark_refuses_new_pushes(model: str) -> None:
    with serving(max_rss_bytes=64 << 20) as srv:  # far below what this process already holds
        with pytest.raises(ResourceExhausted, match=r"would pass its memory high-water mark of 67108864 bytes"):
            LearnerClient(srv.grpc_target).push(1, make_masters(), model=model)
        srv.call(srv.service.wait_pushes(0))


@pytest.fixture
def stalling() -> Iterator[BackgroundServer]:
    with serving(pull_stall_timeout_s=0.5, max_pulls=1) as srv:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.randn(4096, 4096)}, model="big")  # 32 MiB served
        yield srv


def _pulls_done(srv: BackgroundServer) -> None:
    srv.call(srv.service.wait_for(lambda: srv.service.pulls.in_flight == 0), timeout=30)


def test_a_grpc_pull_that_stops_reading_is_dropped_and_frees_its_slot(stalling: BackgroundServer) -> None:
    channel = grpc.insecure_channel(stalling.grpc_target)
    stream = pb_grpc.WeightServiceStub(channel).Pull(pb.PullRequest(model="big"))
    assert next(stream).HasField("manifest")  # then read nothing more
    with pytest.raises(ResourceExhausted, match=r"1 pulls in progress.*\(--max-pulls 1\)"):
        InferenceClient(stalling.grpc_target).pull("big")
    _pulls_done(stalling)  # the server gave up on the stalled reader after 0.5 s
    with pytest.raises(grpc.RpcError) as e:
        for _ in stream:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "the client read nothing for 0.5 s (--pull-stall-timeout-s)" in (e.value.details() or "")
    channel.close()
    assert InferenceClient(stalling.grpc_target).pull("big")["w"].shape == (4096, 4096)


def test_an_http_pull_that_stops_reading_is_dropped_and_frees_its_slot(stalling: BackgroundServer) -> None:
    u = urllib.parse.urlsplit(stalling.http_url)
    with socket.create_connection((u.hostname, u.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /v1/models/big/versions/1/safetensors HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(12) == b"HTTP/1.1 200"  # then read nothing more
        stalling.call(stalling.service.wait_for(lambda: stalling.service.pulls.in_flight == 1))
        with pytest.raises(ResourceExhausted, match=r"\(HTTP 429\)"):
            InferenceClient(stalling.http_url).pull("big")
        _pulls_done(stalling)
        sock.settimeout(10)
        assert closed_by_server(sock)  # the dropped pull's connection goes too
    assert InferenceClient(stalling.http_url).pull("big")["w"].shape == (4096, 4096)


@pytest.mark.parametrize("on_disk", [False, True], ids=["in_memory", "data_dir"])
def test_an_http_pull_whose_client_vanishes_ends_at_once_and_releases_its_version(
    on_disk: bool, tmp_path: Path
) -> None:
    """The body goes out from a writer thread: the loop answers meanwhile, and the thread sees the
    client's reset and gives the version back long before the stall timeout would."""
    with serving(pull_stall_timeout_s=600, max_pulls=1, data_dir=tmp_path if on_disk else None) as srv:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.randn(4096, 4096)}, model="big")  # 32 MiB served
        version = srv.service.index.get("big", 1)
        assert (version.file is not None) == on_disk
        u = urllib.parse.urlsplit(srv.http_url)
        sock = socket.create_connection((u.hostname, u.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /v1/models/big/versions/1/safetensors HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(12) == b"HTTP/1.1 200"  # then read nothing more
        assert version.readers == 1
        with urllib.request.urlopen(f"{srv.http_url}/healthz", timeout=5) as resp:
            assert resp.status == 200  # the loop is free while a writer waits on the client
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset: the client is gone
        _pulls_done(srv)
        assert version.readers == 0
        assert InferenceClient(srv.http_url).pull("big")["w"].shape == (4096, 4096)


def test_idle_connections_are_bounded_and_timed_out_and_the_service_goes_on(model: str) -> None:
    """Connections that send nothing (or half a request) cannot take the service down: beyond
    --max-connections a port closes new ones at once, the others are closed --connect-timeout-s
    after they opened, and meanwhile pushes, pulls and /healthz are served."""
    with serving(max_connections=40, connect_timeout_s=1.0) as srv:
        url = urllib.parse.urlsplit(srv.http_url)
        grpc_port = int(srv.grpc_target.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5)
                for port in (url.port, grpc_port) for _ in range(60)]
        half = socket.create_connection(("127.0.0.1", url.port), timeout=5)
        half.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
        try:
            connections = srv.server._http.server_state.connections  # type: ignore[union-attr]
            assert len(connections) <= 40
            assert all(closed_by_server(s) for s in [*idle, half])  # within the 5 s socket timeout
            with LearnerClient(srv.grpc_target) as learner:
                learner.push(1, make_masters(), model=model)
            for target in (srv.grpc_target, srv.http_url):
                assert sorted(InferenceClient(target).pull(model)) == sorted(make_masters())
        finally:
            for s in [*idle, half]:
                s.close()


def test_at_the_connection_limit_a_request_takes_the_place_of_an_idle_connection() -> None:
    """Idle sockets held open (well within --connect-timeout-s) cannot keep a request out: at
    --max-connections the connection idle longest makes room, and /healthz answers at once."""
    with serving(max_connections=20, connect_timeout_s=60.0) as srv:
        url = urllib.parse.urlsplit(srv.http_url)
        idle = [socket.create_connection(("127.0.0.1", url.port), timeout=5) for _ in range(20)]
        try:
            connections = srv.server._http.server_state.connections  # type: ignore[union-attr]
            for _ in range(3):
                with urllib.request.urlopen(f"{srv.http_url}/healthz", timeout=5) as resp:
                    assert resp.status == 200
            assert len(connections) <= 20
            assert closed_by_server(idle[0])  # the oldest idle one made room
        finally:
            for s in idle:
                s.close()


def test_a_request_head_larger_than_the_limit_is_refused_before_it_is_read_whole() -> None:
    from weightsvc.transport.limits import MAX_HEAD_BYTES

    with serving() as srv:
        url = urllib.parse.urlsplit(srv.http_url)
        with socket.create_connection(("127.0.0.1", url.port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: ")
            answer = b""
            with contextlib.suppress(ConnectionError):
                for _ in range(64):  # 16 MiB, unless the server answers first
                    s.sendall(b"a" * (256 << 10))
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert f"the request head is larger than {MAX_HEAD_BYTES} bytes".encode() in answer
        status, _ = _get(srv.http_url, "/healthz")
        assert status == 200


def _get(base: str, path: str) -> tuple[int, bytes]:
    import http.client

    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _exchange(base: str, request: bytes, timeout: float = 10) -> bytes:
    """Send `request` whole on a socket of its own, then read the answer until the server closes."""
    u = urllib.parse.urlsplit(base)
    answer = b""
    with socket.create_connection(("127.0.0.1", u.port or 80), timeout=timeout) as s:
        s.sendall(request)
        with contextlib.suppress(TimeoutError):
            while chunk := s.recv(65536):
                answer += chunk
                head, ended, body = answer.partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length: *([0-9]+)", head)
                if ended and length and len(body) >= int(length.group(1)):
                    break  # the whole answer, on a connection kept alive
    return answer


def _head_of(size: int) -> bytes:
    """A GET /healthz request head of exactly `size` bytes."""
    start, end = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: ", b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def test_the_head_limit_is_exact_and_a_large_head_is_answered_not_reset() -> None:
    """A head a few bytes over the limit is 431 (it used to pass when it ended in the same read), and a
    1 MiB head sent whole is answered 431 too (closed at once, the client used to see a reset)."""
    from weightsvc.transport.limits import MAX_HEAD_BYTES

    with serving() as srv:
        assert _exchange(srv.http_url, _head_of(MAX_HEAD_BYTES)).startswith(b"HTTP/1.1 200 ")
        for size in (MAX_HEAD_BYTES + 5, 1 << 20):
            answer = _exchange(srv.http_url, _head_of(size))
            assert answer.startswith(b"HTTP/1.1 431 "), (size, answer[:100])
            assert f"the request head is larger than {MAX_HEAD_BYTES} bytes".encode() in answer


def _post_head(path: str, length: int, *, chunked: bool = False) -> bytes:
    size = "transfer-encoding: chunked" if chunked else f"content-length: {length}"
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{size}\r\n\r\n".encode()


def test_request_bodies_over_what_they_can_need_are_413_before_they_are_read(model: str) -> None:
    """A selection's body cannot need more than the version's tensor names with their slices, an
    ack's more than a version and a client id: 413 from the declared size, before reading a byte of
    it (the body is never sent here), or as soon as a chunked body passes the cap."""
    from weightsvc.transport.http import ACK_BODY_BYTES, selection_body_bytes

    with serving() as srv:
        LearnerClient(srv.grpc_target).push(1, make_masters(), model=model)
        cap = selection_body_bytes(srv.service.index.get(model, 1).manifest)
        selection = f"/v1/models/{model}/versions/1/safetensors"
        answer = _exchange(srv.http_url, _post_head(selection, 100 << 20))
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert f"a body of {100 << 20} bytes, more than the {cap} bytes it can need".encode() in answer
        assert f"the selection of model {model!r} version 1".encode() in answer
        answer = _exchange(srv.http_url, _post_head(f"/v1/models/{model}/acks", ACK_BODY_BYTES + 1))
        assert answer.startswith(b"HTTP/1.1 413 ") and f"more than the {ACK_BODY_BYTES} bytes".encode() in answer
        chunk = b"x" * 8192
        chunked = _post_head(f"/v1/models/{model}/acks", 0, chunked=True) + b"%x\r\n%s\r\n" % (len(chunk), chunk)
        assert _exchange(srv.http_url, chunked).startswith(b"HTTP/1.1 413 ")
        # what fits is served as before
        whole = json.dumps({"select": [f"{name}@0:0:1" for name in make_masters() if name != "scalar"]})
        status, body = _post(srv.http_url, selection, whole.encode())
        assert status == 200, body
        assert _post(srv.http_url, f"/v1/models/{model}/acks", b'{"version": 1, "client_id": "a"}')[0] == 200


def _post(base: str, path: str, body: bytes) -> tuple[int, bytes]:
    import http.client

    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_bodies_being_read_count_in_a_budget(model: str) -> None:
    """--max-body-bytes bounds the bodies held at once: while one holds most of it, another that
    would pass it is told to retry (429), and the budget comes back when the first ends."""
    with serving(max_body_bytes=6000, connect_timeout_s=30.0) as srv:
        LearnerClient(srv.grpc_target).push(1, make_masters(), model=model)
        acks = f"/v1/models/{model}/acks"
        slow = socket.create_connection(("127.0.0.1", urllib.parse.urlsplit(srv.http_url).port), timeout=10)
        try:
            slow.sendall(_post_head(acks, 4000) + b"{")  # and the rest later
            reading = srv.service.metrics.request_body_bytes
            deadline = time.monotonic() + 10
            while reading._value.get() != 4000 and time.monotonic() < deadline:
                time.sleep(0.01)  # until the route holds it (nothing to await from here)
            answer = _exchange(srv.http_url, _post_head(acks, 4000))
            assert answer.startswith(b"HTTP/1.1 429 "), answer[:200]
            assert b"would pass --max-body-bytes 6000; retry later" in answer
        finally:
            slow.close()
        deadline = time.monotonic() + 10
        while reading._value.get() != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _post(srv.http_url, acks, b'{"version": 1, "client_id": "a"}' + b" " * 3900)[0] == 200
