"""Delta pulls send only what changed from a version the client holds; the bits are the same."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import serving
from tests.helpers import same_bits, small_step
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import InvalidArgument


@pytest.mark.parametrize("fmt, rounding", [("bf16", "rtn"), ("bf16", "sr-sticky"), ("bf16", "sr"),
                                           ("fp8_e4m3", "rtn")])
def test_delta_pull_gives_the_dense_bits_with_fewer_bytes(fmt: str, rounding: str) -> None:
    with serving(format=fmt, rounding=rounding) as srv:
        gen = torch.Generator().manual_seed(1)
        masters = {"layers.0.weight": (torch.randn(512, 512, generator=gen) * 0.02).to(torch.bfloat16).float()}
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, masters)
        learner.push(2, small_step(masters))
        client = InferenceClient(srv.grpc_target)
        client.pull(version=1)
        delta = client.pull(version=2, base=1)
        delta_bytes = client.last_pull_bytes
        dense = InferenceClient(srv.grpc_target).pull(version=2)
        same_bits(delta, dense)
        data_bytes = srv.service.index.get("default", 2).manifest.data_bytes
        assert delta_bytes < data_bytes
        if rounding in ("rtn", "sr-sticky"):
            assert delta_bytes < data_bytes / 5  # a small step moves few served elements


def test_dense_when_the_delta_would_not_be_smaller_or_the_base_is_gone() -> None:
    with serving(retain=2) as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, {"w": torch.randn(256, 256)})
        learner.push(2, {"w": torch.randn(256, 256)})  # every element changes
        client = InferenceClient(srv.grpc_target)
        client.pull(version=1)
        client.pull(version=2, base=1)
        assert client.last_pull_bytes == srv.service.index.get("default", 2).manifest.data_bytes
        learner.push(3, {"w": torch.randn(256, 256)})  # version 1 is evicted: dense again
        same_bits(client.pull(version=3, base=2), InferenceClient(srv.grpc_target).pull(version=3))
        with pytest.raises(InvalidArgument, match="holds no copy of version 1"):
            InferenceClient(srv.grpc_target).pull(version=3, base=1)
