"""The HTTP routes that match gRPC's Pull with a base, Watch, Ack and ListClients, against a real
server: the same bytes, versions and clients over both transports."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterator

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import serving, start_server
from tests.helpers import http_get, small_step
from weightsvc import LearnerClient
from weightsvc.protocol import delta as delta_codec
from weightsvc.protocol.manifest import Manifest
from weightsvc.server.server import BackgroundServer
from weightsvc.transport import http as http_transport
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc


def bf16_masters(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"layers.0.weight": (torch.randn(256, 256, generator=gen) * 0.02).to(torch.bfloat16).float(),
            "layers.0.bias": torch.zeros(256)}


def http_post(url: str, path: str, body: bytes) -> tuple[int, dict[str, object]]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", path, body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    return resp.status, answer


def data_section(safetensors_file: bytes) -> bytes:
    (header,) = struct.unpack_from("<Q", safetensors_file)
    return safetensors_file[8 + header :]


def grpc_delta(target: str, model: str, version: int, base: int) -> tuple[pb.Delta | None, bytes]:
    """What gRPC Pull sends after its manifest: the Delta message (if any) and the chunks' bytes."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        replies = list(stub.Pull(pb.PullRequest(model=model, version=str(version), base=str(base))))
    header = next((r.delta for r in replies if r.WhichOneof("kind") == "delta"), None)
    return header, b"".join(r.chunk.data for r in replies if r.WhichOneof("kind") == "chunk")


# ---- delta --------------------------------------------------------------------------------------


def test_delta_route_sends_the_grpc_delta_bytes_and_they_apply_to_the_base(
    server: BackgroundServer, model: str
) -> None:
    masters = bf16_masters()
    learner = LearnerClient(server.grpc_target)
    learner.push(1, masters, model=model, format="bf16", rounding="rtn")  # few served elements move
    learner.push(2, small_step(masters), model=model, format="bf16", rounding="rtn")
    status, headers, body = http_get(server.http_url, f"/v1/models/{model}/versions/latest/delta?base=1")
    assert status == 200, body
    _, file_headers, v2_file = http_get(server.http_url, f"/v1/models/{model}/versions/2/safetensors")
    assert headers["content-type"] == "application/octet-stream"
    assert (headers["x-weightsvc-model"], headers["x-weightsvc-version"]) == (model, "2")
    assert headers["x-weightsvc-base-version"] == "1"
    assert headers["etag"] == file_headers["etag"]
    assert int(headers["content-length"]) == len(body) < len(data_section(v2_file)) / 5
    grpc_header, grpc_body = grpc_delta(server.grpc_target, model, 2, 1)
    assert grpc_header is not None and (grpc_header.base_version, grpc_header.delta_bytes) == (1, len(body))
    assert body == grpc_body
    base = bytearray(data_section(http_get(server.http_url, f"/v1/models/{model}/versions/1/safetensors")[2]))
    manifest = Manifest.from_dict(json.loads(http_get(server.http_url, f"/v1/models/{model}/versions/2/manifest")[2]))
    delta_codec.apply(manifest, memoryview(body), memoryview(base))
    assert bytes(base) == data_section(v2_file)


def test_delta_route_says_why_there_is_no_delta(server: BackgroundServer, model: str) -> None:
    learner = LearnerClient(server.grpc_target)
    learner.push(1, {"w": torch.randn(128, 128)}, model=model)
    learner.push(2, {"w": torch.randn(128, 128)}, model=model)  # every element changes
    learner.push(3, {"other": torch.randn(8)}, model=model)
    route = f"/v1/models/{model}/versions"
    for path, reason in [
        (f"{route}/2/delta?base=1", "would not be smaller than the 32768 dense bytes"),
        (f"{route}/2/delta?base=2", "that is the version itself"),
        (f"{route}/2/delta?base=7", f"model {model!r} has no version 7"),
        (f"{route}/3/delta?base=2", "the base has other tensors, shapes or dtypes"),
    ]:
        status, _, body = http_get(server.http_url, path)
        error = json.loads(body)["error"]
        assert (status, error["code"]) == (409, "FAILED_PRECONDITION"), (path, body)
        assert error["message"].startswith(f"model {model!r} version {path.split('/')[5]}: no delta against base ")
        assert reason in error["message"] and error["message"].endswith("pull the whole version"), error
    for path, code in [
        (f"{route}/9/delta?base=1", (404, "NOT_FOUND")),
        ("/v1/models/no-such-model/versions/latest/delta?base=1", (404, "NOT_FOUND")),
        (f"{route}/2/delta?base=one", (400, "INVALID_ARGUMENT")),
        (f"{route}/2/delta?base=-1", (400, "INVALID_ARGUMENT")),
        (f"{route}/2/delta", (400, "INVALID_ARGUMENT")),
        (f"{route}/two/delta?base=1", (400, "INVALID_ARGUMENT")),
    ]:
        status, _, body = http_get(server.http_url, path)
        assert (status, json.loads(body)["error"]["code"]) == code, (path, body)
    # Nothing stays held: the failed and finished pulls all let go of their versions.
    assert server.call(_pulls_in_flight(server)) == 0


async def _pulls_in_flight(srv: BackgroundServer) -> float:
    return sum(s.value for f in text_string_to_metric_families(srv.service.metrics.render().decode())
               if f.name == "weightsvc_pulls_in_flight" for s in f.samples)


def test_a_delta_pull_that_stops_reading_is_dropped_and_lets_go_of_its_version(model: str) -> None:
    w = torch.zeros(1 << 22)
    with serving(pull_stall_timeout_s=0.5, format="bf16", rounding="rtn") as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, {"w": w}, model=model)
        learner.push(2, {"w": w + torch.arange(1 << 22) % 3 * 0.5}, model=model)  # a third of it unchanged
        u = urllib.parse.urlsplit(srv.http_url)
        with socket.create_connection((u.hostname, u.port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(f"GET /v1/models/{model}/versions/2/delta?base=1 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert sock.recv(12) == b"HTTP/1.1 200"  # then read nothing more
            srv.call(srv.service.wait_for(lambda: srv.service.pulls.in_flight == 1))
            srv.call(srv.service.wait_for(lambda: srv.service.pulls.in_flight == 0), timeout=30)  # dropped after 0.5 s
        status, _, body = http_get(srv.http_url, f"/v1/models/{model}/versions/2/delta?base=1")
        assert status == 200 and body == grpc_delta(srv.grpc_target, model, 2, 1)[1]


# ---- watch --------------------------------------------------------------------------------------


class EventReader:
    """Reads a server-sent event stream on a thread; `next()` gives each event's fields (comments as
    {"comment": ...}), None once the stream ended."""

    def __init__(self, url: str, path: str, headers: dict[str, str] | None = None) -> None:
        u = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.conn.request("GET", path, headers=headers or {})
        self.resp = self.conn.getresponse()
        self._events: list[dict[str, str] | None] = []
        self._arrived = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        event: dict[str, str] = {}
        try:
            for raw in self.resp:
                line = raw.decode().rstrip("\n")
                if line.startswith(":"):
                    self._put({"comment": line[1:].strip()})
                elif line:
                    key, _, value = line.partition(": ")
                    event[key] = value
                elif event:
                    self._put(event)
                    event = {}
        except (OSError, http.client.HTTPException):
            pass
        self._put(None)

    def _put(self, event: dict[str, str] | None) -> None:
        with self._arrived:
            self._events.append(event)
            self._arrived.notify_all()

    def next(self, timeout: float = 60) -> dict[str, str] | None:
        with self._arrived:
            assert self._arrived.wait_for(lambda: self._events, timeout), "no event arrived"
            return self._events.pop(0)

    def close(self) -> None:
        if self.conn.sock is not None:  # the reader sees the end of the stream, then the socket closes
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(30)
        self.conn.close()


@pytest.fixture
def watch_of(server: BackgroundServer) -> Iterator[list[EventReader]]:
    readers: list[EventReader] = []
    yield readers
    for reader in readers:
        reader.close()


def test_watch_streams_every_push_in_order_and_resumes_after_the_last_event_id(
    server: BackgroundServer, model: str, watch_of: list[EventReader]
) -> None:
    learner = LearnerClient(server.grpc_target)
    learner.push(1, {"w": torch.ones(4)}, model=model)
    watch_of.append(reader := EventReader(server.http_url, f"/v1/models/{model}/watch"))
    assert reader.resp.status == 200 and reader.resp.getheader("content-type", "").startswith("text/event-stream")
    for step in (2, 3, 5):
        learner.push(step, {"w": torch.full((4,), float(step))}, model=model)
    listing = json.loads(http_get(server.http_url, f"/v1/models/{model}/versions")[2])["versions"]
    events = [reader.next() for _ in listing]
    assert [(e["id"], e["event"]) for e in events if e] == [("1", "version"), ("2", "version"), ("3", "version"),
                                                            ("5", "version")]
    assert [json.loads(e["data"]) for e in events if e] == listing
    # A reconnect resumes after the last event it got (the header wins over the URL's `after`), and
    # `after` alone also leaves out what the client holds.
    watch_of.append(resumed := EventReader(server.http_url, f"/v1/models/{model}/watch?after=1",
                                           {"Last-Event-ID": "3"}))
    watch_of.append(after := EventReader(server.http_url, f"/v1/models/{model}/watch?after=2"))
    learner.push(6, {"w": torch.full((4,), 6.0)}, model=model)
    assert [(e or {}).get("id") for e in (resumed.next(), resumed.next())] == ["5", "6"]
    assert [(e or {}).get("id") for e in (after.next(), after.next(), after.next())] == ["3", "5", "6"]
    assert (reader.next() or {}).get("id") == "6"


def test_watch_errors_are_json_before_the_stream_starts(server: BackgroundServer) -> None:
    for path, headers, status in [
        ("/v1/models/bad name!/watch", {}, 400),
        ("/v1/models/m/watch?after=x", {}, 400),
        ("/v1/models/m/watch", {"Last-Event-ID": "not-a-version"}, 400),
    ]:
        got, response_headers, body = http_get(server.http_url, path.replace(" ", "%20"), headers)
        assert (got, response_headers["content-type"]) == (status, "application/json"), (path, body)
        assert json.loads(body)["error"]["code"] == "INVALID_ARGUMENT"


def test_an_idle_watch_sends_keepalives_and_ends_when_the_server_stops(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    monkeypatch.setattr(http_transport, "KEEPALIVE_S", 0.2)
    srv = start_server()
    channel = grpc.insecure_channel(srv.grpc_target)
    try:
        reader = EventReader(srv.http_url, f"/v1/models/{model}/watch")  # before the model has a version
        assert reader.next() == {"comment": "keepalive"}
        LearnerClient(srv.grpc_target).push(1, {"w": torch.ones(4)}, model=model)
        event = reader.next()
        while event == {"comment": "keepalive"}:
            event = reader.next()
        assert event is not None and event["id"] == "1"
        over_grpc = pb_grpc.WeightServiceStub(channel).Watch(pb.WatchRequest(model=model))
        assert next(over_grpc).version.version == 1
    finally:
        stopping = threading.Thread(target=srv.__exit__, args=(None, None, None))
        started = time.monotonic()
        stopping.start()
        stopping.join(30)
    assert not stopping.is_alive(), "an open watch held up the server's shutdown"
    assert time.monotonic() - started < 10
    while (event := reader.next()) is not None:  # the stream ended: the client reconnects elsewhere
        assert event == {"comment": "keepalive"}
    reader.close()
    with pytest.raises(grpc.RpcError) as ended:  # gRPC watchers are told to come back
        next(over_grpc)
    assert (ended.value.code(), ended.value.details()) == (
        grpc.StatusCode.UNAVAILABLE, "the server is stopping: watch again, after the last version received"
    )
    channel.close()


# ---- ack and clients ----------------------------------------------------------------------------


def _client_metrics(url: str, model: str) -> dict[str, float]:
    body = http_get(url, "/metrics")[2].decode()
    return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
            if s.labels.get("model") == model and not s.name.endswith(("_bucket", "_created"))}


def test_http_ack_moves_the_client_listing_and_metrics_and_list_clients_matches(
    server: BackgroundServer, model: str
) -> None:
    learner = LearnerClient(server.grpc_target)
    for step in (1, 2, 3):
        learner.push(step, {"w": torch.full((4,), float(step))}, model=model)
    acks = f"/v1/models/{model}/acks"
    assert http_post(server.http_url, acks, b'{"version": 1, "client_id": "pod-a"}') == (200, {"latest_version": 3})
    assert http_post(server.http_url, acks, b'{"version": 3}') == (200, {"latest_version": 3})
    listing = json.loads(http_get(server.http_url, f"/v1/models/{model}/clients")[2])
    assert (listing["model"], listing["latest_version"]) == (model, 3)
    by_id = {c["client_id"]: c for c in listing["clients"]}
    peer = next(i for i in by_id if i != "pod-a")
    assert peer.startswith("127.0.0.1:")  # no client_id: the peer's address, as gRPC Ack does
    assert {(i, c["version"], c["lag_versions"], c["connected"]) for i, c in by_id.items()} == {
        ("pod-a", 1, 2, True), (peer, 3, 0, True)
    }
    assert all(time.time() - c["last_seen_unix"] < 60 for c in by_id.values())
    metrics = _client_metrics(server.http_url, model)
    assert (metrics["weightsvc_clients"], metrics["weightsvc_client_lag_versions"]) == (2, 2)
    assert metrics["weightsvc_version_sync_seconds_count"] == 2

    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        reply = stub.ListClients(pb.ListClientsRequest(model=model))
        with pytest.raises(grpc.RpcError) as unknown:
            stub.ListClients(pb.ListClientsRequest(model="no-such-model"))
    assert (reply.model, reply.latest_version) == (model, 3)
    assert [
        {"client_id": c.client_id, "version": c.version, "lag_versions": c.lag_versions,
         "last_seen_unix": c.last_seen_unix, "connected": c.connected}
        for c in reply.clients
    ] == listing["clients"]
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    status, _, body = http_get(server.http_url, "/v1/models/no-such-model/clients")
    assert (status, json.loads(body)["error"]["message"]) == (404, unknown.value.details())


def test_http_ack_errors_match_grpc_ack(server: BackgroundServer, model: str) -> None:
    LearnerClient(server.grpc_target).push(1, {"w": torch.ones(4)}, model=model)
    acks = f"/v1/models/{model}/acks"
    for path, body, status, code in [
        ("/v1/models/no-such-model/acks", b'{"version": 1}', 404, "NOT_FOUND"),
        (acks, b'{"version": 2, "client_id": "c"}', 400, "INVALID_ARGUMENT"),
        (acks, b'{"version": 1, "client_id": "' + b"x" * 300 + b'"}', 400, "INVALID_ARGUMENT"),
        (acks, b'{"client_id": "c"}', 400, "INVALID_ARGUMENT"),
        (acks, b'{"version": "one"}', 400, "INVALID_ARGUMENT"),
        (acks, b"not json", 400, "INVALID_ARGUMENT"),
    ]:
        got, answer = http_post(server.http_url, path, body)
        error = answer["error"]
        assert (got, error["code"]) == (status, code), (body, answer)  # type: ignore[index]
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError) as over_grpc:
        pb_grpc.WeightServiceStub(channel).Ack(pb.AckRequest(model=model, version=2, client_id="c"))
    _, answer = http_post(server.http_url, acks, b'{"version": 2, "client_id": "c"}')
    assert answer["error"]["message"] == over_grpc.value.details()  # type: ignore[index]


def test_the_http_server_sends_small_responses_without_waiting_nagle(server: BackgroundServer) -> None:
    """Every accepted connection has TCP_NODELAY: without it, a small response on a kept-alive
    connection waits for the client's delayed ack (about 40 ms a request)."""
    parts = urllib.parse.urlsplit(server.http_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port)
    try:
        conn.request("GET", "/healthz")
        conn.getresponse().read()

        async def nodelay() -> list[int]:
            connections = server.server._http.server_state.connections  # type: ignore[union-attr]
            socks = [c.transport.get_extra_info("socket") for c in connections]
            return [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks]

        flags = server.call(nodelay())
        assert flags and all(flags), flags
    finally:
        conn.close()


# ---- what a request sends is echoed bounded, and read as ASCII -------------------------------------


def test_an_unsatisfiable_range_is_echoed_as_a_short_excerpt(server: BackgroundServer, model: str) -> None:
    LearnerClient(server.grpc_target).push(1, {"w": torch.ones(4)}, model=model)
    long_range = "bytes=99999999-" + "9" * 5000  # 5 KB, unsatisfiable
    status, _, body = http_get(server.http_url, f"/v1/models/{model}/versions/1/safetensors", {"Range": long_range})
    assert status == 416
    message = json.loads(body)["error"]["message"]
    assert len(message) < 300 and "bytes=99999999-999" in message and "(5015 characters)" in message


def test_selectors_and_ranges_take_ascii_digits_only(server: BackgroundServer, model: str) -> None:
    """"\u0661" is a digit to Python's int(): a selector with such digits is the name of a tensor
    (none here), and such a Range is no range (the whole file)."""
    LearnerClient(server.grpc_target).push(1, {"w": torch.ones(4, 4)}, model=model)
    path = f"/v1/models/{model}/versions/1/safetensors"
    status, _, body = http_get(server.http_url, f"{path}?select=" + urllib.parse.quote("w@0:\u0660:\u0662"))
    assert status == 400 and "has no tensor 'w@0:\u0660:\u0662'" in json.loads(body)["error"]["message"]
    assert http_get(server.http_url, f"{path}?select=" + urllib.parse.quote("w@0:0:2"))[0] == 200
    whole = http_get(server.http_url, path)[2]
    status, _, body = http_get(server.http_url, path, {"Range": "bytes=\u0661-".encode().decode("latin-1")})
    assert (status, body) == (200, whole)
