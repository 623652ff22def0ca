"""The "weightsvc" checkpoint engine in verl 0.9.1 itself: its registry and abstract engine, verl's own
worker code around it, and a real service.

verl's CPU test of how its workers call an engine (tests/checkpoint_engine/test_global_steps_on_cpu.py)
drives `ActorRolloutRefWorker.update_weights` and `CheckpointEngineWorker.update_weights` on workers
made without their model engines; the same here, with this engine in them and the topology verl's
manager builds (prepare on every worker, build_topology, init_process_group). Two trainer ranks push
(each its share), two rollout workers receive the served copy, bit for bit the service's export.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.workers.engine_workers import ActorRolloutRefWorker

from tests.conftest import make_masters, serving
from tests.helpers import assert_served, same_bits, small_step
from weightsvc import InferenceClient
from weightsvc.errors import AlreadyExists
from weightsvc.integrations.verl import BACKEND, WeightsvcCheckpointEngine, split_by_bytes

ROOT = Path(__file__).resolve().parents[2]
BUCKET = 2048 << 20  # verl's default update_weights_bucket_megabytes, as verl passes it


class PerTensorParams:
    """The part of verl's model engine that `update_weights` calls: full tensors, one at a time."""

    def __init__(self, masters: dict[str, torch.Tensor]) -> None:
        self.masters = masters

    def get_per_tensor_param(self) -> tuple[Any, None]:
        return iter(self.masters.items()), None  # (no PEFT config)


class Adapter:
    """The server adapter's `update_weights`, as verl's rollout worker calls it."""

    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.global_steps: int | None = None

    async def update_weights(self, weights: Any, global_steps: int | None = None, **kwargs: Any) -> None:
        self.received = {name: t.clone() async for name, t in weights}
        self.global_steps = global_steps


def trainer_worker(engine: CheckpointEngine, masters: dict[str, torch.Tensor]) -> ActorRolloutRefWorker:
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.config = SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=SimpleNamespace(backend=BACKEND)))
    worker.actor = SimpleNamespace(engine=PerTensorParams(masters))
    worker.checkpoint_engine = engine
    return worker


def rollout_worker(engine: CheckpointEngine) -> CheckpointEngineWorker:
    worker = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
    worker.checkpoint_engine = engine
    worker.server_adapter = Adapter()
    return worker


def engines(trainers: int, rollouts: int, **kwargs: Any) -> tuple[list[CheckpointEngine], list[CheckpointEngine]]:
    """Built as verl builds them: the trainer's in `ActorRolloutRefWorker`, the rollout's in
    `CheckpointEngineWorker`."""
    return ([CheckpointEngineRegistry.new(BACKEND, is_master=r == 0, bucket_size=BUCKET, **kwargs)
             for r in range(trainers)],
            [CheckpointEngineRegistry.new(BACKEND, bucket_size=BUCKET, **kwargs) for _ in range(rollouts)])


def join(trainers: list[CheckpointEngine], rollouts: list[CheckpointEngine]) -> None:
    """`CheckpointEngineManager.build_process_group`: prepare, build_topology, init_process_group."""
    metadata = [e.prepare() for e in trainers + rollouts]
    trainer_kwargs, rollout_kwargs = CheckpointEngineRegistry.get(BACKEND).build_topology(
        len(trainers), len(rollouts), metadata)
    for kwargs, workers in ((trainer_kwargs, trainers), (rollout_kwargs, rollouts)):
        assert all(len(v) == len(workers) for v in kwargs.values())
        for i, e in enumerate(workers):
            e.init_process_group(**{k: v[i] for k, v in kwargs.items()})


def update(trainers: list[ActorRolloutRefWorker], rollouts: list[CheckpointEngineWorker],
           global_steps: int | None) -> list[Any]:
    """One update as verl's manager runs it on its workers, then `finalize` on every engine."""
    join([w.checkpoint_engine for w in trainers], [w.checkpoint_engine for w in rollouts])

    async def run() -> list[Any]:
        return list(await asyncio.gather(
            *(ActorRolloutRefWorker.update_weights.__wrapped__(w, global_steps=global_steps, mode="auto")
              for w in trainers),
            *(CheckpointEngineWorker.update_weights.__wrapped__(w, global_steps=global_steps) for w in rollouts)))

    results = asyncio.run(run())
    for w in trainers + rollouts:
        w.checkpoint_engine.finalize()
    return results[:len(trainers)]


def test_the_backend_is_a_registered_verl_checkpoint_engine() -> None:
    cls = CheckpointEngineRegistry.get(BACKEND)
    assert cls is WeightsvcCheckpointEngine
    assert issubclass(cls, CheckpointEngine) and not cls.__abstractmethods__
    # verl passes global_steps by keyword to both halves
    for method in (cls.send_weights, cls.receive_weights):
        assert "global_steps" in inspect.signature(method).parameters
    assert cls.wire_format == "named_tensors"


def test_verl_finds_the_backend_through_its_plugin_entry_point() -> None:
    """A process that only imports verl (as each of verl's Ray workers does) has the backend: nothing
    imports weightsvc by hand, nothing is configured."""
    code = "import verl.checkpoint_engine as ce; print(ce.CheckpointEngineRegistry.get('weightsvc').__module__)"
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240, check=True)
    assert out.stdout.strip().splitlines()[-1] == "weightsvc.integrations.verl"


def test_trainer_ranks_push_and_rollouts_receive_the_served_copy(model: str) -> None:
    with serving() as srv:
        masters = make_masters(seed=5)
        for step in (1, 2):  # new engines each time: nothing is kept between updates but the service's versions
            trainer_engines, rollout_engines = engines(2, 2, target=srv.grpc_target, model=model)
            trainers = [trainer_worker(e, masters) for e in trainer_engines]
            rollouts = [rollout_worker(e) for e in rollout_engines]
            metrics = update(trainers, rollouts, global_steps=step)
            assert metrics == [{"weightsvc/version": float(step)}] * 2
            received = [w.server_adapter.received for w in rollouts]  # type: ignore[attr-defined]
            assert_served(received[0], masters, step)
            same_bits(received[0], received[1])
            assert [w.server_adapter.global_steps for w in rollouts] == [step, step]  # type: ignore[attr-defined]
            masters = small_step(masters, lr=1e-2, seed=step)
        with InferenceClient(srv.grpc_target) as client:
            assert [v.version for v in client.versions(model)] == [1, 2]
            # each rollout worker acked what it loaded (the engines of each update are new: four clients)
            assert sorted(c.version for c in client.clients(model)) == [1, 1, 2, 2]


def test_an_update_again_at_the_same_step_re_pushes_and_one_without_a_step_takes_the_latest(model: str) -> None:
    """verl updates twice at one `global_steps` (validation, critic warm-up) and sometimes without
    one: both leave the masters unchanged and must neither fail nor number a new version."""
    with serving() as srv:
        masters = make_masters(seed=8)
        trainer_engines, rollout_engines = engines(2, 1, target=srv.grpc_target, model=model)
        trainers = [trainer_worker(e, masters) for e in trainer_engines]
        rollouts = [rollout_worker(e) for e in rollout_engines]
        for global_steps in (0, 0, None):
            update(trainers, rollouts, global_steps)
            assert_served(rollouts[0].server_adapter.received, masters, 0)  # type: ignore[attr-defined]
        with InferenceClient(srv.grpc_target) as client:
            assert [v.version for v in client.versions(model)] == [0]
        # a step that changed the masters at a step the service holds is refused, naming it
        for w in trainers:
            w.actor.engine.masters = small_step(masters, lr=1e-2, seed=1)
        with pytest.raises(AlreadyExists, match=rf"model '{model}' version 0 is already committed with different"):
            update(trainers, [], global_steps=0)
        with InferenceClient(srv.grpc_target) as client:
            assert_served(client.pull(model, 0), masters, 0)


def test_a_worker_that_did_not_join_the_update_refuses(model: str) -> None:
    trainer, rollout = (e[0] for e in engines(1, 1, target="127.0.0.1:1", model=model))
    with pytest.raises(RuntimeError, match="before init_process_group"):
        asyncio.run(trainer.send_weights(iter([]), global_steps=1))

    async def first() -> object:
        return await anext(rollout.receive_weights(global_steps=1))  # type: ignore[call-overload]

    with pytest.raises(RuntimeError, match="before init_process_group"):
        asyncio.run(first())


def test_shares_are_disjoint_complete_and_balanced() -> None:
    full = {f"t{i}": torch.zeros(n) for i, n in enumerate([1000, 10, 500, 490, 7, 1, 999, 3])}
    shares = [split_by_bytes(iter(full.items()), rank, 3) for rank in range(3)]
    names = [n for s in shares for n in s]
    assert sorted(names) == sorted(full)  # each tensor on exactly one rank
    sizes = [sum(t.numel() for t in s.values()) for s in shares]
    assert max(sizes) - min(sizes) <= max(t.numel() for t in full.values())
    assert all(s for s in shares)
