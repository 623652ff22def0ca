"""A pull broken mid-stream resumes from its offset (gRPC and HTTP), through a proxy that cuts the
first connection after a few MiB."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import CuttingProxy, assert_served
from weightsvc import InferenceClient, LearnerClient
from weightsvc.server.server import BackgroundServer


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
