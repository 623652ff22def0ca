"""A pull broken mid-stream resumes from its offset (gRPC and HTTP), through a proxy that cuts the
first connection after a few MiB."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import start_server
from tests.integration.test_push_pull import assert_served
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client._common import READ_BYTES
from weightsvc.server.server import BackgroundServer

CUT_AFTER = 12 << 20
# What a client may have received and not yet counted: a partial gRPC chunk, or one HTTP read.
HELD_BACK = max(1 << 20, READ_BYTES) + (1 << 20)


class CuttingProxy:
    """Forwards 127.0.0.1:port to `upstream`. The first connection stops after `cut_after` bytes
    down, waits until the client has read them (counted by `progress`, the pull's progress
    callback), then dies: a cut of the bytes the client already has, not of what the transport
    buffered (gRPC drops the messages it holds when its connection dies), so a resume can be told
    from a restart by the bytes after the cut (`assert_resumed`)."""

    def __init__(self, upstream: tuple[str, int], cut_after: int = CUT_AFTER) -> None:
        assert cut_after > HELD_BACK
        self.upstream = upstream
        self.cut_after = cut_after
        self.received = 0  # by the client
        self.read = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.down: list[int] = []  # bytes forwarded to the client, per connection
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def progress(self, n: int) -> None:
        self.received += n
        if self.received >= self.cut_after - HELD_BACK:
            self.read.set()

    def assert_resumed(self, data_bytes: int) -> None:
        """The pull was cut once, and after the cut the wire carried the rest of its `data_bytes`
        from about where the client had got to, not all of them again."""
        assert self.cut.is_set() and self.read.is_set() and len(self.down) >= 2
        assert sum(self.down[1:]) < data_bytes - self.cut_after + HELD_BACK, (self.down, data_bytes)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.down.append(0)
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, len(self.down) - 1), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        self._hang_up(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket, i: int) -> None:
        limit = self.cut_after if i == 0 else None
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16 if limit is None else min(1 << 16, limit - self.down[i])):
                dst.sendall(data)
                self.down[i] += len(data)
                if limit is not None and self.down[i] >= limit:
                    self.read.wait(timeout=60)
                    self.cut.set()
                    break
        self._hang_up(src, dst)

    @staticmethod
    def _hang_up(*sockets: socket.socket) -> None:
        for s in sockets:  # a hard cut, both ways
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[BackgroundServer, dict[str, torch.Tensor]]]:
    srv = start_server()
    masters = {"w": torch.randn(4096, 2048) * 0.02}  # 16 MiB served
    LearnerClient(srv.grpc_target).push(1, masters)
    yield srv, masters
    srv.__exit__(None, None, None)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_broken_pull_resumes_from_its_offset(served: tuple[BackgroundServer, dict[str, torch.Tensor]],
                                               transport: str) -> None:
    srv, masters = served
    port = int((srv.grpc_target if transport == "grpc" else srv.http_url).rsplit(":", 1)[1])
    proxy = CuttingProxy(("127.0.0.1", port))
    try:
        target = f"127.0.0.1:{proxy.port}" if transport == "grpc" else f"http://127.0.0.1:{proxy.port}"
        pulled = InferenceClient(target).pull(progress=proxy.progress)
        assert_served(pulled, masters, 1)
        proxy.assert_resumed(srv.service.index.get("default", 1).manifest.data_bytes)
    finally:
        proxy.close()


def test_resume_offset_outside_the_data_section(served: tuple[BackgroundServer, dict[str, torch.Tensor]]) -> None:
    import grpc

    from weightsvc.v1 import weightsvc_pb2 as pb
    from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

    srv, _ = served
    with grpc.insecure_channel(srv.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.WeightServiceStub(channel).Pull(pb.PullRequest(model="default", version="1", offset=1 << 40)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume offset" in info.value.details()
