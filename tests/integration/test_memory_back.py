"""Memory comes back: a real server process's anonymous memory (RssAnon) after pushes that never
commit returns to where it was: an aborted push's buffer is kept only at a size the next push can
use, and a refused push of many tensors leaves neither its header's objects nor the heap they took."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from tests.conftest import ServeProcess, serving
from weightsvc import LearnerClient
from weightsvc.errors import FailedPrecondition
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

MIB = 1 << 20


@pytest.fixture
def server() -> Iterator[ServeProcess]:
    server = ServeProcess()
    try:
        yield server
    finally:
        server.stop()


def rss_anon(server: ServeProcess) -> float:
    return server.memory()["RssAnon"] / MIB


def settled_growth(server: ServeProcess, before: float, bound: float, timeout: float = 15.0) -> float:
    """RssAnon above `before` once it is within `bound`, or when `timeout` has passed: the server gives
    the heap back a moment after a push ends, and nothing tells another process when."""
    deadline = time.monotonic() + timeout
    while (growth := rss_anon(server) - before) >= bound and time.monotonic() < deadline:
        time.sleep(0.2)
    return growth


def test_six_aborted_pushes_of_distinct_sizes_leave_no_buffers_behind(server: ServeProcess) -> None:
    LearnerClient(server.target).push(1, {"w": np.ones(16, np.float32)}, model="small")
    before = rss_anon(server)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.WeightServiceStub(channel)
        for i, numel in enumerate(range(10 * MIB, 40 * MIB, 5 * MIB)):  # 20 ... 70 MiB served (bf16)
            tensor = pb.TensorSpec(name="w", shape=[numel], dtype="F32")
            stream = [pb.PushRequest(header=pb.PushHeader(model="big", step=1 + i, tensors=[tensor])),
                      pb.PushRequest(chunk=pb.Chunk(tensor="w", offset=0, data=np.ones(1024, np.float32).tobytes()))]
            with pytest.raises(grpc.RpcError) as e:
                stub.Push(iter(stream))  # the stream ends without a commit: aborted
            assert e.value.code() == grpc.StatusCode.ABORTED
    assert settled_growth(server, before, 32) < 32  # 270 MiB: one buffer of each size, kept for a push of that size


def test_a_refused_push_of_100000_tensors_gives_its_memory_back(server: ServeProcess) -> None:
    with LearnerClient(server.target) as learner:
        learner.push(2, {"w": np.ones(16, np.float32)}, model="moe")
        masters = {f"model.layers.{i // 1000:02d}.mlp.experts.{i % 1000:03d}.down_proj.weight_{i:06d}":
                   np.zeros(4, np.float32) for i in range(100_000)}
        before = rss_anon(server)
        for _ in range(2):
            with pytest.raises(FailedPrecondition, match="step 1"):  # refused once its header is read
                learner.push(1, masters, model="moe")
    assert settled_growth(server, before, 24) < 24  # 140 MiB: the error kept its header, the heap its pages


def test_a_refused_push_leaves_none_of_its_messages_behind() -> None:
    """gRPC's request stream and gRPC's objects of its call hold each other: a stream a refused push
    left suspended kept the last message it had received (at 100,000 tensors, a 4.5 MiB piece of the
    header) until a full collection, which `serve` makes rare: RssAnon grew 4.5 MiB with every such
    push, for good. With no collection at all, none is left."""
    def held() -> int:
        return sum(type(o) is pb.PushRequest for o in gc.get_objects())

    spec = pb.TensorSpec(name="w", shape=[16], dtype="F32")
    header = pb.PushRequest(header=pb.PushHeader(model="moe", step=1, tensors=[spec]))
    gc.disable()
    try:
        with serving() as srv, grpc.insecure_channel(srv.grpc_target) as channel:
            with LearnerClient(srv.grpc_target) as learner:
                learner.push(2, {"w": np.ones(16, np.float32)}, model="moe")
            before = held()
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as e:
                    pb_grpc.WeightServiceStub(channel).Push(iter([header]))  # refused once its header is read
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            deadline = time.monotonic() + 10
            while held() > before and time.monotonic() < deadline:
                time.sleep(0.1)
            assert held() <= before  # (the push before them may still have had one in hand)
    finally:
        gc.enable()
