"""Pushes by several learner ranks (FSDP / tensor-parallel shards) against a real gRPC server."""

from __future__ import annotations

import errno
import math
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import pytest
import torch

from tests.conftest import make_masters, serving, target
from tests.helpers import CHUNK, bits, push_ranks
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import Shard, VersionInfo
from weightsvc.errors import Aborted, DeadlineExceeded, Internal, InvalidArgument, NotFound, ResourceExhausted
from weightsvc.server.server import BackgroundServer
from weightsvc.service.push.messages import PushChunk


def masters(seed: int = 0) -> dict[str, torch.Tensor]:
    m = make_masters(seed)
    m["layers.0.mlp.down.weight"] = torch.randn(600, 512, generator=torch.Generator().manual_seed(seed)) * 0.02
    return m  # the last one spans two 1 MiB digest blocks


def flat_shards(state: Mapping[str, torch.Tensor], world_size: int) -> list[dict[str, torch.Tensor | Shard]]:
    """FSDP-style: every tensor's flat elements cut at uneven points, one range per rank."""
    ranks: list[dict[str, torch.Tensor | Shard]] = [{} for _ in range(world_size)]
    for i, (name, t) in enumerate(state.items()):
        flat = t.reshape(-1)
        n = flat.numel()
        cuts = [0] + [min(n, (n * (r + 1) + 7 * i) // world_size) for r in range(world_size - 1)] + [n]
        for r in range(world_size):  # a small tensor leaves some ranks an empty range
            ranks[r][name] = Shard(flat[cuts[r] : cuts[r + 1]].clone(), cuts[r], tuple(t.shape))
    return ranks


def assert_same_version(puller: InferenceClient, model_a: str, model_b: str, version: int) -> None:
    a, b = puller.pull(model_a, version), puller.pull(model_b, version)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.array_equal(bits(a[name]), bits(b[name])), name
    ma, mb = puller.manifest(model_a, version), puller.manifest(model_b, version)
    assert ma.master_digest == mb.master_digest
    # By name: tensors that ranks hold whole are laid out in the order the ranks declare them.
    assert {t.name: t.checksum for t in ma.tensors} == {t.name: t.checksum for t in mb.tensors}
    assert ma.lag == mb.lag


@pytest.mark.parametrize(("format", "rounding", "world_size"), [("bf16", "sr", 2), ("fp8_e4m3", "sr", 2),
                                                                  ("bf16", "sr-sticky", 3)])
def test_flat_range_shards_from_several_ranks_serve_the_bits_of_a_one_rank_push(
    server: BackgroundServer, model: str, format: str, rounding: str, world_size: int, push_transport: str
) -> None:
    state = masters()
    with LearnerClient(server.grpc_target) as learner:
        one = learner.push(3, state, model=model + "-one", format=format, rounding=rounding)
    results = push_ranks(target(server, push_transport), 3, flat_shards(state, world_size), model + "-ranks",
                         format=format, rounding=rounding)
    infos = [f.result() for f in results]
    assert {(i.version, i.created, i.tensor_count, i.data_bytes) for i in infos} == {
        (3, True, one.tensor_count, one.data_bytes)
    }
    with InferenceClient(server.grpc_target) as puller:
        assert_same_version(puller, model + "-one", model + "-ranks", 3)


def test_ef_across_steps_with_two_ranks_matches_one_rank_and_the_local_fair_cast(
    server: BackgroundServer, model: str
) -> None:
    state = masters()
    with LearnerClient(server.grpc_target) as learner, InferenceClient(server.grpc_target) as puller:
        for step in range(1, 4):
            state = {n: t + 3e-6 * torch.sign(t) for n, t in state.items()}
            learner.push(step, state, model=model + "-one", rounding="ef")
            infos = push_ranks(server.grpc_target, step, flat_shards(state, 2), model + "-ranks", rounding="ef",
                               return_served=True)
            served = infos[1].result().served
            assert served is not None
            assert_same_version(puller, model + "-one", model + "-ranks", step)
            expected = puller.pull(model + "-one", step)
            assert all(np.array_equal(bits(served[n]), bits(expected[n])) for n in expected)


def test_whole_tensors_split_between_ranks_and_mixed_with_shards(server: BackgroundServer, model: str) -> None:
    state = masters(1)
    names = list(state)
    rank0: dict[str, torch.Tensor | Shard] = {n: state[n] for n in names[:3]}
    rank1: dict[str, torch.Tensor | Shard] = {n: state[n] for n in names[3:-1]}
    big = state[names[-1]].reshape(-1)
    rank0[names[-1]] = Shard(big[:1000], 0, tuple(state[names[-1]].shape))
    rank1[names[-1]] = Shard(big[1000:], 1000, tuple(state[names[-1]].shape))
    for f in push_ranks(server.grpc_target, 1, [rank0, rank1], model):
        assert f.result().tensor_count == len(state)
    with LearnerClient(server.grpc_target) as learner, InferenceClient(server.grpc_target) as puller:
        learner.push(1, state, model=model + "-one")
        assert_same_version(puller, model + "-one", model, 1)


def errors(futures: list[Future[VersionInfo]]) -> list[BaseException | None]:
    return [f.exception() for f in futures]


def assert_nothing_visible(server: BackgroundServer, model: str) -> None:
    with InferenceClient(server.grpc_target) as puller, pytest.raises(NotFound):
        puller.manifest(model)
    server.call(server.service.wait_pushes(0))  # every staging buffer released


Cut = Callable[[dict[str, torch.Tensor]], list[dict[str, torch.Tensor | Shard]]]


def _gap(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor | Shard]]:
    w = state["embed.weight"].reshape(-1)
    return [{"embed.weight": Shard(w[:100], 0, (97, 64))}, {"embed.weight": Shard(w[150:], 150, (97, 64))}]


def _overlap(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor | Shard]]:
    w = state["embed.weight"].reshape(-1)
    return [{"embed.weight": Shard(w[:200], 0, (97, 64))}, {"embed.weight": Shard(w[150:], 150, (97, 64))}]


def _shapes(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor | Shard]]:
    w = state["embed.weight"].reshape(-1)
    return [{"embed.weight": Shard(w[:100], 0, (97, 64))}, {"embed.weight": Shard(w[100:], 100, (64, 97))}]


def _whole_twice(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor | Shard]]:
    return [{"scalar": state["scalar"]}, {"scalar": state["scalar"]}]


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (_gap, r"tensor 'embed.weight' of shape \[97, 64\]: no rank pushes elements \[100, 150\)"),
        (
            _overlap,
            r"tensor 'embed.weight': the part of rank 1 \(elements \[150, 6208\)\) overlaps the part of "
            r"rank 0, which ends at element 200",
        ),
        (_shapes, r"tensor 'embed.weight': rank 0 declares shape \[97, 64\], rank 1 declares \[64, 97\]"),
        (_whole_twice, r"tensor 'scalar': the part of rank 1 \(elements \[0, 1\)\) overlaps"),
    ],
    ids=["gap", "overlap", "shapes", "whole-twice"],
)
def test_ranks_whose_parts_do_not_tile_a_tensor_are_refused_before_any_data(
    server: BackgroundServer, model: str, cut: Cut, message: str
) -> None:
    for error in errors(push_ranks(server.grpc_target, 1, cut(make_masters()), model)):
        assert isinstance(error, InvalidArgument)
        assert f"model {model!r} step 1" in str(error)
        assert re.search(message, str(error)), error
    assert_nothing_visible(server, model)


def test_rank_outside_world_size_and_a_rank_twice_are_refused(
    server: BackgroundServer, model: str, push_transport: str
) -> None:
    state = make_masters()
    with LearnerClient(target(server, push_transport)) as learner:
        with pytest.raises(InvalidArgument, match=r"rank 2 is outside world_size 2"):
            learner.push(1, state, model=model, rank=2, world_size=2)
        with pytest.raises(InvalidArgument, match=r"world_size -1 is not in \[1, 65536\]"):
            learner.push(1, state, model=model, rank=0, world_size=-1)
    assert_nothing_visible(server, model)


def test_a_rank_that_never_arrives_leaves_nothing_visible_after_the_rank_timeout(model: str) -> None:
    with serving(push_rank_timeout_s=0.5) as srv, LearnerClient(srv.grpc_target) as learner:
        state = make_masters()
        with pytest.raises(DeadlineExceeded, match=r"rank\(s\) 1 of world_size 2 did not join within 0.5 s"):
            learner.push(1, state, model=model, rank=0, world_size=2)
        assert_nothing_visible(srv, model)
        # The same step pushed again by both ranks commits: the failed group is gone.
        futures = push_ranks(srv.grpc_target, 1, flat_shards(state, 2), model)
        assert [f.result().version for f in futures] == [1, 1]


def test_a_rank_that_breaks_off_mid_stream_aborts_every_rank(server: BackgroundServer, model: str) -> None:
    state = masters()
    parts = flat_shards(state, 2)
    sent = [0]

    def break_off(n: int) -> None:
        sent[0] += n
        if sent[0] > 4 * CHUNK:
            # Mid-stream: once both ranks have joined and the version is being staged.
            sessions = server.service.pushes.sessions
            server.call(server.service.wait_for(lambda: any(p.header.model == model for p in sessions)))
            raise ConnectionAbortedError("learner rank 1 died")

    pool = ThreadPoolExecutor(2)
    with (
        LearnerClient(server.grpc_target, chunk_bytes=CHUNK) as a,
        LearnerClient(server.grpc_target, chunk_bytes=CHUNK) as b,
    ):
        rank0 = pool.submit(a.push, 1, parts[0], model, rank=0, world_size=2)
        rank1 = pool.submit(b.push, 1, parts[1], model, rank=1, world_size=2, progress=break_off)
        pool.shutdown(wait=True)
    assert rank1.exception() is not None
    error = rank0.exception()
    assert isinstance(error, Aborted), error
    assert f"model {model!r} step 1: rank 1 of 2 failed, so the push is aborted" in str(error)
    assert_nothing_visible(server, model)


def test_ranks_that_disagree_on_world_size_or_rounding_are_refused(server: BackgroundServer, model: str) -> None:
    state = make_masters()
    parts = flat_shards(state, 2)
    with LearnerClient(server.grpc_target) as a, LearnerClient(server.grpc_target) as b:
        pool = ThreadPoolExecutor(1)
        rank0 = pool.submit(a.push, 1, parts[0], model, rank=0, world_size=2)
        server.call(server.service.wait_for(lambda: bool(server.service.pushes.joining)))
        with pytest.raises(InvalidArgument, match=r"rank 1: world_size 3, but the push in progress has world_size 2"):
            b.push(1, parts[1], model, rank=1, world_size=3)
        with pytest.raises(InvalidArgument, match=r"rank 0: this rank is already pushing"):
            b.push(1, parts[0], model, rank=0, world_size=2)
        with pytest.raises(InvalidArgument, match=r"rank 1: format '' rounding 'rtn', but the other ranks"):
            b.push(1, parts[1], model, rank=1, world_size=2, rounding="rtn")
        info = b.push(1, parts[1], model, rank=1, world_size=2)
        pool.shutdown(wait=True)
        assert rank0.result() == info
    assert math.prod(InferenceClient(server.grpc_target).pull(model)["embed.weight"].shape) == 97 * 64


def answered(futures: list[Future[VersionInfo]]) -> list[BaseException | None]:
    """Every rank's outcome; fails (instead of hanging) if a rank is left without an answer."""
    _, waiting = wait(futures, timeout=60)
    assert not waiting, f"{len(waiting)} rank(s) got no answer"
    return [f.exception() for f in futures]


def test_an_error_while_staging_is_opened_answers_every_rank(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    def no_memory(nbytes: int) -> memoryview:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    state = make_masters()
    with serving() as srv:
        monkeypatch.setattr(srv.service.pushes.context, "alloc", no_memory)  # mapping the staging buffer fails
        errors = answered(push_ranks(srv.grpc_target, 1, flat_shards(state, 2), model))
        for error in errors:
            assert isinstance(error, ResourceExhausted), error
            assert f"model {model!r} step 1: opening its staging session failed: OSError" in str(error)
        assert_nothing_visible(srv, model)
        monkeypatch.undo()  # and the next push of the step commits
        assert [f.result().version for f in push_ranks(srv.grpc_target, 1, flat_shards(state, 2), model)] == [1, 1]


def test_an_unexpected_exception_on_one_rank_fails_every_rank(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    def fault_on_rank_1(rank: int, chunks: Sequence[PushChunk]) -> None:
        if rank == 1:
            raise RuntimeError("injected fault")

    state = make_masters()
    with serving() as srv:
        monkeypatch.setattr(srv.service.pushes.context, "on_chunks", fault_on_rank_1)
        rank0, rank1 = answered(push_ranks(srv.grpc_target, 1, flat_shards(state, 2), model))
        assert isinstance(rank1, Internal), rank1
        assert f"model {model!r} step 1: rank 1's stream failed: RuntimeError: injected fault" in str(rank1)
        assert isinstance(rank0, Aborted), rank0
        assert "rank 1 of 2 failed, so the push is aborted" in str(rank0) and "injected fault" in str(rank0)
        assert_nothing_visible(srv, model)
        monkeypatch.undo()
        assert [f.result().version for f in push_ranks(srv.grpc_target, 1, flat_shards(state, 2), model)] == [1, 1]
