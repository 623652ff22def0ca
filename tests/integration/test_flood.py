"""Clients that hold connections cannot crowd out a learner: tokenless gRPC connections are closed,
watchers have a bound of their own, slow request bodies a deadline, and /healthz and /readyz answer
whoever holds the connections. The attackers here are raw sockets (HTTP/1.1 and HTTP/2 by hand), as
an attacker's own script would be."""

from __future__ import annotations

import contextlib
import http.client
import os
import selectors
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

import weightsvc
from tests.conftest import ServeProcess, make_masters, serving
from tests.helpers import closed_by_server
from weightsvc import InferenceClient, LearnerClient
from weightsvc.protocol.names import SERVICE
from weightsvc.server.server import BackgroundServer
from weightsvc.transport import _internals
from weightsvc.transport.connections import GrpcConnections, _sockets, parse_peer
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

TOKENS = {"WEIGHTSVC_PULL_TOKENS": "pull-secret", "WEIGHTSVC_PUSH_TOKENS": "push-secret"}
PULL, PUSH = "pull-secret", "push-secret"

# ---- HTTP/2 by hand: a gRPC call with no token, as a script without grpcio sends it -------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _int7(n: int) -> bytes:
    """An HPACK integer with a 7-bit prefix (no Huffman)."""
    if n < 127:
        return bytes([n])
    out, n = [127], n - 127
    while n >= 128:
        out.append(n % 128 + 128)
        n //= 128
    return bytes([*out, n])


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _tokenless_call(port: int, method: str = "ListModels") -> socket.socket:
    """A connection that made one gRPC call without a token (its answer not read yet)."""
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", f"/{SERVICE}/{method}".encode()),
              (b":authority", b"flood"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    block = b"".join(b"\x00" + _int7(len(k)) + k + _int7(len(v)) + v for k, v in fields)  # literal, not indexed
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(PREFACE + _frame(4, 0, 0, b"") + _frame(1, 4, 1, block) + _frame(0, 1, 1, b"\0" * 5))
    return sock


def _answered(sock: socket.socket) -> bool:
    """Read the server's frames until the call's end (a HEADERS frame ending the stream), acking its
    SETTINGS as a client must; False if the connection ended first."""
    buffer = b""
    while True:
        while len(buffer) >= 9:
            size = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + size:
                break
            kind, flags = buffer[3], buffer[4]
            buffer = buffer[9 + size:]
            if kind == 4 and not flags & 1:
                sock.sendall(_frame(4, 1, 0, b""))
            if kind == 1 and flags & 1:
                return True
        more = sock.recv(65536)
        if not more:
            return False
        buffer += more


def _dropped_by_grpc(srv: BackgroundServer, batch: list[socket.socket], within_s: float = 10) -> bool:
    """Whether gRPC lets go of the server's ends of `batch` (shut by the server, seen closed by their
    clients) within `within_s`: only then are their places among gRPC's admitted connections free
    again. gRPC drops a shut connection on its own thread, with no event to wait on: this looks at the
    server's sockets until then."""
    ours = {parse_peer(f"ipv4:{host}:{port}") for host, port in (s.getsockname() for s in batch)}
    deadline = time.monotonic() + within_s
    while ours & _sockets(_grpc_port(srv)).keys():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _grpc_port(srv: BackgroundServer) -> int:
    return int(srv.grpc_target.rsplit(":", 1)[1])


def _http_port(url: str) -> int:
    return urllib.parse.urlsplit(url).port or 80


def _status(url: str, path: str, token: str | None = None, timeout: float = 10) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", _http_port(url), timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_connections_that_fail_authentication_are_closed_and_a_learner_pushes(model: str) -> None:
    """Tokenless connections that each made one call would hold --max-connections for as long as
    they like: each is closed once its refusal is sent, and a learner with a token pushes."""
    with serving(max_connections=20, pull_tokens=PULL, push_tokens=PUSH) as srv:
        attackers = []
        try:
            for _ in range(2):  # the bound's worth, and again: the first ones' places came back
                attackers += (batch := [_tokenless_call(_grpc_port(srv)) for _ in range(20)])
                assert all(_answered(s) for s in batch)
                assert all(closed_by_server(s, 10) for s in batch)
                assert _dropped_by_grpc(srv, batch)
            with LearnerClient(srv.grpc_target, token=PUSH) as learner:
                assert learner.push(1, make_masters(), model=model).version == 1
            dropped = srv.service.metrics.connections_dropped.labels("grpc", "unauthenticated")._value.get()
            assert dropped >= 40
        finally:
            for s in attackers:
                s.close()


def test_a_refused_connection_is_closed_only_once_its_answer_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection of a call that failed authentication is handed to be closed only once the
    refusal has gone out: closed at that very moment, its client still reads its answer first."""

    def close_at_once(self: GrpcConnections, peer: str) -> None:
        p = parse_peer(peer)
        assert p is not None
        fd, address = _sockets(self.port)[p]
        assert _internals.shut_down(fd, self.port, address)

    monkeypatch.setattr(GrpcConnections, "refused", close_at_once)
    with serving(pull_tokens=PULL, push_tokens=PUSH) as srv:
        for method in ("ListModels", "Watch", "Pull"):  # unary and streaming handlers
            sock = _tokenless_call(_grpc_port(srv), method)
            try:
                assert _answered(sock)
                assert closed_by_server(sock, 10)
            finally:
                sock.close()


def _watch_channels(target: str, model: str, count: int) -> list[tuple[grpc.Channel, Iterator[pb.VersionEvent]]]:
    """`count` gRPC watchers, each on a connection of its own, each holding its first event."""
    out = []
    for i in range(count):
        channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1), ("flood.i", i)])
        stream = pb_grpc.WeightServiceStub(channel).Watch(pb.WatchRequest(model=model))
        assert next(stream).version.version == 1
        out.append((channel, stream))
    return out


def test_grpc_watchers_cannot_take_every_connection_and_the_oldest_makes_room(model: str) -> None:
    """Watchers, one connection each, as many as --max-connections: a push still gets in; the
    watches beyond half the connections end, the oldest first, with UNAVAILABLE (come back)."""
    with serving(max_connections=8) as srv:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.ones(4)}, model=model)
        watchers = _watch_channels(srv.grpc_target, model, 8)
        try:
            with LearnerClient(srv.grpc_target) as learner:
                assert learner.push(2, {"w": torch.full((4,), 2.0)}, model=model).version == 2
            codes = []
            for _, stream in watchers:
                try:
                    codes.append(next(stream).version.version)
                except grpc.RpcError as e:
                    codes.append(e.code())
                    assert "--max-watches" in (e.details() or "")
            # (the watch limit is half of --max-connections: 4)
            assert codes == [grpc.StatusCode.UNAVAILABLE] * 4 + [2] * 4
            assert srv.service.metrics.watches._value.get() == 4
        finally:
            for channel, _ in watchers:
                channel.close()


class _Sse:
    """An HTTP watcher on a socket: the events it has read so far."""

    def __init__(self, url: str, model: str, last_event_id: int | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", _http_port(url)), timeout=10)
        resume = f"Last-Event-ID: {last_event_id}\r\n" if last_event_id is not None else ""
        self.sock.sendall(f"GET /v1/models/{model}/watch HTTP/1.1\r\nhost: x\r\n{resume}\r\n".encode())
        self.data = b""

    def read_until(self, text: bytes) -> bytes:
        while text not in self.data:
            more = self.sock.recv(65536)
            assert more, self.data
            self.data += more
        return self.data


def test_watches_beyond_their_bound_end_the_oldest_first_and_resume(model: str) -> None:
    with serving(max_watches=2) as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, {"w": torch.ones(4)}, model=model)
        first, second = _Sse(srv.http_url, model), _Sse(srv.http_url, model)
        for w in (first, second):
            w.read_until(b"id: 1\n")
        with grpc.insecure_channel(srv.grpc_target) as channel:
            third = pb_grpc.WeightServiceStub(channel).Watch(pb.WatchRequest(model=model))
            assert next(third).version.version == 1
            assert first.read_until(b"\r\n0\r\n\r\n").endswith(b"\r\n0\r\n\r\n")  # its stream ended
            learner.push(2, {"w": torch.full((4,), 2.0)}, model=model)
            assert next(third).version.version == 2
            assert b"id: 2\n" in second.read_until(b"id: 2\n")
            resumed = _Sse(srv.http_url, model, last_event_id=1)  # as EventSource comes back
            assert b"id: 2\n" in resumed.read_until(b"id: 2\n") and b"id: 1\n" not in resumed.data
            assert second.read_until(b"\r\n0\r\n\r\n")  # the oldest now made room
            assert srv.service.metrics.watches_evicted._value.get() == 2
        for w in (first, second, resumed):
            w.sock.close()


def _trickle(url: str, path: str, token: str | None = None) -> socket.socket:
    """A POST whose body comes a byte at a time, its first byte sent."""
    sock = socket.create_connection(("127.0.0.1", _http_port(url)), timeout=10)
    auth = f"authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json\r\n"
                 f"content-length: 100\r\n\r\n{{".encode())
    return sock


def test_slow_bodies_are_dropped_and_health_answers_while_they_hold_every_connection(model: str) -> None:
    with serving(max_connections=10, connect_timeout_s=1.0) as srv:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.ones(4)}, model=model)
        slow = [_trickle(srv.http_url, f"/v1/models/{model}/acks") for _ in range(10)]
        try:
            started = time.monotonic()
            reading = srv.service.metrics.request_body_bytes
            while reading._value.get() < 10 * 100 and time.monotonic() - started < 10:
                time.sleep(0.01)  # until the route reads every body (nothing to await from here)
            for path in ("/healthz", "/readyz"):  # every connection is busy: these come in as probes
                assert _status(srv.http_url, path)[0] == 200
            status, body = _status(srv.http_url, "/v1/models")
            assert status == 503 and b"--max-connections" in body
            assert all(closed_by_server(s, 10) for s in slow)
            assert time.monotonic() - started < 8  # a 100-byte body: 1 s past its head
        finally:
            for s in slow:
                s.close()
        assert _status(srv.http_url, "/v1/models")[0] == 200


# ---- the flood: everything at once against a server of its own -------------------------------------


class Flood:
    """Holds SSE watchers (with a pull token, resuming 1 s after their stream ends), tokenless gRPC
    connections (renewed as they close) and trickling POST bodies at their counts, from one thread."""

    RENEW_PER_S = 200  # connections of each kind reopened a second, once all are open

    def __init__(self, url: str, grpc_port: int, model: str, counts: dict[str, int]) -> None:
        self.http_port, self.grpc_port, self.model, self.counts = _http_port(url), grpc_port, model, counts
        self.open: dict[str, dict[socket.socket, float]] = {kind: {} for kind in counts}
        self.closed = dict.fromkeys(counts, 0)
        self.stop = threading.Event()
        self.filled = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        assert self.filled.wait(120), {k: len(v) for k, v in self.open.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(30)
        for socks in self.open.values():
            for s in socks:
                s.close()

    def held(self) -> dict[str, int]:
        return {kind: len(socks) for kind, socks in self.open.items()}

    def _watch_request(self) -> bytes:
        return (f"GET /v1/models/{self.model}/watch HTTP/1.1\r\nhost: x\r\n"
                f"authorization: Bearer {PULL}\r\nLast-Event-ID: 1\r\n\r\n").encode()

    def _connect(self, kind: str) -> socket.socket:
        if kind == "tokenless":
            sock = _tokenless_call(self.grpc_port)
        elif kind == "watch":
            sock = socket.create_connection(("127.0.0.1", self.http_port), timeout=10)
            sock.sendall(self._watch_request())
        else:
            sock = _trickle(f"http://127.0.0.1:{self.http_port}", f"/v1/models/{self.model}/acks", PULL)
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, kind)
        return sock

    def _run(self) -> None:
        next_byte = last = time.monotonic()
        allowance = dict.fromkeys(self.counts, 0.0)
        while not self.stop.is_set():
            now = time.monotonic()
            for kind, count in self.counts.items():
                # At first as fast as it can; then renewed up to RENEW_PER_S a second.
                allowance[kind] = min(self.RENEW_PER_S, allowance[kind] + (now - last) * self.RENEW_PER_S)
                missing = count - len(self.open[kind])
                room = missing if not self.filled.is_set() else min(missing, int(allowance[kind]))
                allowance[kind] -= room if self.filled.is_set() else 0
                for _ in range(room):
                    with contextlib.suppress(OSError):
                        self.open[kind][self._connect(kind)] = 0.0  # (for a watch: when to ask again)
            last = now
            if all(len(self.open[k]) >= c for k, c in self.counts.items()):
                self.filled.set()
            for key, _ in self._selector.select(0.05):
                sock, kind = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._selector.unregister(sock)
                    sock.close()
                    del self.open[kind][sock]
                    self.closed[kind] += 1
                elif kind == "tokenless" and data[3:5] == b"\x04\x00":
                    sock.send(_frame(4, 1, 0, b""))  # ack the server's SETTINGS
                elif kind == "watch" and data.endswith(b"\r\n0\r\n\r\n"):
                    self.open[kind][sock] = time.monotonic() + 1.0  # evicted: back in a second
            now = time.monotonic()
            for sock, due in list(self.open.get("watch", {}).items()):
                if due and now >= due:
                    self.open["watch"][sock] = 0.0
                    with contextlib.suppress(OSError):
                        sock.send(self._watch_request())
            if now >= next_byte:  # a byte a second on each trickling body
                next_byte = now + 1.0
                for sock in list(self.open.get("trickle", {})):
                    with contextlib.suppress(OSError):
                        sock.send(b" ")


def _sockets_of(pid: int) -> int:
    count = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:")
    return count


@pytest.mark.slow
def test_a_flood_of_watchers_tokenless_connections_and_slow_bodies_leaves_the_learner_pushing(model: str) -> None:
    """1,000 SSE watchers, 1,000 tokenless gRPC connections and 50 trickling bodies at once, renewed
    as the server closes them, at the default --max-connections of 1,000: a learner pushes, a
    puller pulls, /readyz answers, and the memory the flood took comes back."""
    counts = {"watch": 1000, "tokenless": 1000, "trickle": 50}
    # (the weightsvc under test, also where the installed command's editable install points elsewhere)
    here = str(Path(weightsvc.__file__).parents[1])
    srv = ServeProcess("--connect-timeout-s", "5", env={**TOKENS, "PYTHONPATH": here})
    try:
        with LearnerClient(srv.target, token=PUSH) as learner:
            learner.push(1, make_masters(), model=model)
        before = srv.memory()["RssAnon"]
        with Flood(srv.url, int(srv.target.rsplit(":", 1)[1]), model, counts) as flood:
            held = flood.held()
            server_sockets = _sockets_of(srv.proc.pid)
            started = time.monotonic()
            with LearnerClient(srv.target, token=PUSH) as learner:
                assert learner.push(2, make_masters(1), model=model).version == 2
            push_s = time.monotonic() - started
            pulled = InferenceClient(srv.url, token=PULL).pull(model)
            assert sorted(pulled) == sorted(make_masters())
            latencies = []
            for _ in range(20):
                started = time.monotonic()
                assert _status(srv.url, "/readyz")[0] == 200
                latencies.append(time.monotonic() - started)
            closed = dict(flood.closed)
        after_s = time.monotonic()
        while _sockets_of(srv.proc.pid) > 50 and time.monotonic() - after_s < 30:
            time.sleep(0.2)  # the server closes what the flood left (nothing to await from here)
        after = srv.memory()["RssAnon"]
        latencies.sort()
        print(f"\nflood held (client side) {held}, server sockets {server_sockets}; push {push_s:.2f} s; "
              f"/readyz p50 {latencies[10] * 1e3:.1f} ms max {latencies[-1] * 1e3:.1f} ms; closed by the server "
              f"{closed}; RssAnon {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")
        assert latencies[-1] < 2.0
        assert after - before < 256 << 20
    finally:
        srv.kill()
