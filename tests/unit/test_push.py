"""A push through the push package alone, on a context built here: no server, no transport.

Its header checks, the layout plan of several ranks' shards, and what a refused or failed push
leaves behind (nothing: no version, no staging memory, no reservation)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import re
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from weightsvc import rounding
from weightsvc.errors import Aborted, Internal, InvalidArgument, ResourceExhausted, WeightsvcError
from weightsvc.memory import BufferPool
from weightsvc.metrics import Metrics
from weightsvc.protocol.manifest import TensorSpec
from weightsvc.service.device import Exporter
from weightsvc.service.push.context import PushContext
from weightsvc.service.push.messages import PushChunk, PushCommit, PushHeader, PushMessage
from weightsvc.service.push.plan import MASTER_ITEMSIZE, make_plan
from weightsvc.service.push.pushes import Pushes
from weightsvc.service.push.validate import validate_header
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.commit import Committer
from weightsvc.service.versions.index import VersionIndex
from weightsvc.settings import Settings

SPEC = rounding.ExportSpec("bf16", "rtn", 0, "tensor", "")


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


def context(executor: ThreadPoolExecutor, exporter: Exporter | None = None, **settings: object) -> PushContext:
    """What a push needs, wired as the service wires it (an embedded registry, no data dir)."""
    s = Settings(rounding="rtn", push_idle_timeout_s=5, push_rank_timeout_s=5, **settings)  # type: ignore[arg-type]
    metrics, registry = Metrics(), MemoryRegistry()
    index = VersionIndex(s.retain, metrics)
    parts = Parts(registry, s.retain)
    committer = Committer(index=index, files=None, parts=parts, acks=Acks(index, registry, metrics),
                          registry=registry, metrics=metrics)
    export = exporter or Exporter()
    return PushContext(settings=s, metrics=metrics, executor=executor, loop=asyncio.get_running_loop(),
                       exporter=lambda: export, pool=BufferPool(), files=None, committer=committer, parts=parts,
                       index=index)


def header(tensors: tuple[TensorSpec, ...], *, rank: int = 0, world_size: int = 1, step: int = 1) -> PushHeader:
    return PushHeader("m", step, tensors, rank=rank, world_size=world_size)


async def stream(head: PushHeader, masters: dict[str, np.ndarray]) -> AsyncIterator[PushMessage]:
    """A rank's stream: its header, each shard's bytes in one chunk, its commit."""
    yield head
    for spec in head.tensors:
        start, count = spec.elements
        data = masters[spec.name].reshape(-1)[start : start + count].tobytes()
        yield [PushChunk(spec.name, start * MASTER_ITEMSIZE, data)]
    yield PushCommit()


def left_nothing(pushes: Pushes) -> None:
    """No version, no staging session, no reservation, no staged byte."""
    ctx = pushes.context
    assert ctx.index.models() == []
    assert pushes.sessions == set() and pushes.joining == {}
    assert pushes.budget.reserved == 0
    assert ctx.metrics.staged_bytes._value.get() == 0


# ---- the header ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TensorSpec("w", (4,), "BF16"), r"tensor 'w' is BF16; masters are pushed as F32"),
        (TensorSpec("w", (4,), "F33"), r"tensor 'w' has unknown dtype 'F33'"),
        (TensorSpec("w", (4, -1)), r"tensor 'w' has a negative dimension in shape \[4, -1\]"),
        (TensorSpec("w", (10,), part=(8, 4)), r"tensor 'w': part \[8, 12\) is not within its 10 elements"),
        (TensorSpec("__metadata__", (4,)), r"'__metadata__' is reserved by the safetensors format"),
    ],
)
def test_a_header_with_a_bad_dtype_shape_or_name_is_refused_naming_the_tensor(spec: TensorSpec, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as info:
        validate_header(header((spec,)), Settings())
    assert info.value.reason == "invalid_header"


def test_a_header_over_a_size_limit_is_refused_with_the_flag_to_raise() -> None:
    with pytest.raises(ResourceExhausted, match=r"tensor 'w' .* more than the 100 bytes a tensor may have "
                                                r"\(--max-tensor-bytes\)"):
        validate_header(header((TensorSpec("w", (26,)),)), Settings(max_tensor_bytes=100))


def test_a_rank_outside_its_world_size_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"rank 2 is outside world_size 2"):
        validate_header(header((TensorSpec("w", (4,)),), rank=2, world_size=2), Settings())


# ---- the plan -----------------------------------------------------------------------------------


def test_a_plan_gives_each_rank_the_bytes_of_its_shards_in_the_slots_of_whole_tensors() -> None:
    whole = header((TensorSpec("a", (10,)), TensorSpec("b", (2, 3))))
    ranks = {0: (TensorSpec("a", (10,), part=(0, 4)), TensorSpec("b", (2, 3))),
             1: (TensorSpec("a", (10,), part=(4, 6)),)}
    plan = make_plan(whole, SPEC, ranks, "model 'm' step 1")
    assert {rank: {n: (s.start, s.end) for n, s in shards.items()} for rank, shards in plan.shards.items()} == {
        0: {"a": (0, 16), "b": (0, 24)},
        1: {"a": (16, 40)},
    }
    assert plan.shards[0]["a"].tensor is plan.shards[1]["a"].tensor  # one tensor, its shards from two ranks
    slots = sorted((s.offset, s.offset + s.nbytes) for s in plan.slots)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(slots))  # no slot overlaps another
    assert plan.data_bytes >= 2 * (10 + 6) and plan.numel == 16


def test_a_plan_refuses_an_alias_of_a_tensor_the_push_does_not_declare() -> None:
    aliased = dataclasses.replace(header((TensorSpec("w", (4,)),)), aliases=(("lm_head", "embed"),))
    with pytest.raises(InvalidArgument, match=r"alias 'lm_head' names tensor 'embed', which the push does not"):
        make_plan(aliased, SPEC, {0: aliased.tensors}, "model 'm' step 1")


# ---- whole pushes -------------------------------------------------------------------------------


async def test_a_push_of_two_ranks_commits_one_version_of_whole_tensors(executor: ThreadPoolExecutor) -> None:
    pushes = Pushes(context(executor))
    masters = {"a": np.arange(10, dtype=np.float32), "b": np.ones((2, 3), np.float32)}
    rank0 = header((TensorSpec("a", (10,), part=(0, 4)), TensorSpec("b", (2, 3))), rank=0, world_size=2)
    rank1 = header((TensorSpec("a", (10,), part=(4, 6)),), rank=1, world_size=2)
    (v0, created0), (v1, _) = await asyncio.gather(pushes.run(stream(rank0, masters)),
                                                   pushes.run(stream(rank1, masters)))
    assert v0 is v1 and created0
    assert [(t.name, t.shape) for t in v0.manifest.tensors] == [("a", (10,)), ("b", (2, 3))]
    served = np.frombuffer(v0.data, np.uint16, count=10, offset=v0.manifest.tensors[0].offset)
    assert (rounding.decode(served, rounding.FORMATS["bf16"]) == masters["a"]).all()  # small integers: exact
    assert pushes.sessions == set() and pushes.budget.reserved == 0


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ((6, 4), r"tensor 'w' of shape \[10\]: no rank pushes elements \[4, 6\)"),
        ((3, 7), r"tensor 'w': the part of rank 1 \(elements \[3, 10\)\) overlaps the part of rank 0, which ends "
                 r"at element 4"),
    ],
)
async def test_shards_with_a_gap_or_an_overlap_fail_every_rank_naming_the_tensor(
    executor: ThreadPoolExecutor, second: tuple[int, int], message: str
) -> None:
    pushes = Pushes(context(executor))
    masters = {"w": np.zeros(10, np.float32)}
    heads = [header((TensorSpec("w", (10,), part=(0, 4)),), rank=0, world_size=2),
             header((TensorSpec("w", (10,), part=second),), rank=1, world_size=2)]
    outcomes = await asyncio.gather(*(pushes.run(stream(h, masters)) for h in heads), return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, InvalidArgument), outcome
        assert outcome.reason == "invalid_header"
        assert re.search(f"model 'm' step 1: {message}", str(outcome)), outcome
    left_nothing(pushes)


async def test_a_push_whose_export_fails_leaves_nothing(executor: ThreadPoolExecutor) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the export broke")

    exporter = Exporter()
    exporter.export_array = broken  # type: ignore[method-assign]
    exporter.export_runs = broken  # type: ignore[method-assign]
    pushes = Pushes(context(executor, exporter))
    head = header((TensorSpec("w", (1 << 16,)), TensorSpec("b", (4,))))
    with pytest.raises(WeightsvcError, match=r"model 'm' step 1: .* failed: RuntimeError: the export broke; "
                                             r"nothing was committed") as info:
        await pushes.run(stream(head, {"w": np.zeros(1 << 16, np.float32), "b": np.zeros(4, np.float32)}))
    assert isinstance(info.value, Internal)
    left_nothing(pushes)


async def test_a_fault_on_one_rank_aborts_the_other_and_leaves_nothing(executor: ThreadPoolExecutor) -> None:
    ctx = context(executor)

    def fault_on_rank_1(rank: int, chunks: object) -> None:
        if rank == 1:
            raise RuntimeError("injected fault")

    ctx.on_chunks = fault_on_rank_1
    pushes = Pushes(ctx)
    masters = {"w": np.zeros(10, np.float32)}
    heads = [header((TensorSpec("w", (10,), part=(0, 5)),), rank=0, world_size=2),
             header((TensorSpec("w", (10,), part=(5, 5)),), rank=1, world_size=2)]
    rank0, rank1 = await asyncio.gather(*(pushes.run(stream(h, masters)) for h in heads), return_exceptions=True)
    assert isinstance(rank1, Internal) and "rank 1's stream failed: RuntimeError: injected fault" in str(rank1)
    assert isinstance(rank0, Aborted) and "rank 1 of 2 failed, so the push is aborted" in str(rank0)
    left_nothing(pushes)


async def test_a_released_session_is_freed_at_once_not_by_the_garbage_collector(executor: ThreadPoolExecutor) -> None:
    """A session left in a reference cycle would keep its mappings (a residual file's blocks on a full
    disk) until the collector ran."""
    ctx = context(executor)
    pushes = Pushes(ctx)
    seen: list[weakref.ref[object]] = []
    ctx.changed = lambda: seen.extend(weakref.ref(s) for s in pushes.sessions)
    gc.disable()
    try:
        await pushes.run(stream(header((TensorSpec("w", (4,)),)), {"w": np.zeros(4, np.float32)}))
        assert seen and all(ref() is None for ref in seen)
    finally:
        gc.enable()
