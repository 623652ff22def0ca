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
from weightsvc.server.server import BackgroundServer

CUT_AFTER = 3 << 20


class CuttingProxy:
    """Forwards 127.0.0.1:port to `upstream`; the first connection dies after CUT_AFTER bytes down."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(self.upstream)
            limit = CUT_AFTER if self.connections == 1 else None
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, limit), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
                sent += len(data)
                if limit is not None and sent >= limit:
                    self.cut.set()
                    break
        for s in (src, dst):  # a hard cut, both ways
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[BackgroundServer, dict[str, torch.Tensor]]]:
    srv = start_server()
    masters = {"w": torch.randn(2048, 2048) * 0.02}  # 8 MiB served
    LearnerClient(srv.grpc_target).push(1, masters)
    yield srv, masters
    srv.__exit__(None, None, None)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_broken_pull_resumes_from_its_offset(served: tuple[BackgroundServer, dict[str, torch.Tensor]],
                                               transport: str) -> None:  # fmt: skip
    srv, masters = served
    port = int((srv.grpc_target if transport == "grpc" else srv.http_url).rsplit(":", 1)[1])
    proxy = CuttingProxy(("127.0.0.1", port))
    try:
        target = f"127.0.0.1:{proxy.port}" if transport == "grpc" else f"http://127.0.0.1:{proxy.port}"
        counter = srv.service.metrics.pull_bytes.labels("default", transport)
        before = counter._value.get()
        pulled = InferenceClient(target).pull()
        assert proxy.cut.is_set() and proxy.connections >= 2
        assert_served(pulled, masters, 1)
        data_bytes = srv.service.manifest("default", 1).data_bytes
        # Resumed, not restarted: far less than twice the version went out.
        assert counter._value.get() - before < data_bytes + CUT_AFTER + (4 << 20)
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
