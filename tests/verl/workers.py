"""Trainer and rollout workers for verl's `CheckpointEngineManager` under Ray, as verl's own test of its
checkpoint engines builds them (verl 0.9.1, tests/checkpoint_engine/test_utils.py: `TrainingWorkerTest`,
`CheckpointEngineWorkerTest` with its server adapter, `MockReplica`), with a tiny Llama's fp32 masters
in place of its FSDP engine: a module Ray's worker processes import by name."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.rollout import BaseRollout, RolloutReplica

from tests.engines.engines import masters
from tests.helpers import small_step


def llama_masters(step: int) -> dict[str, torch.Tensor]:
    """The fp32 masters after `step` optimizer steps (each a seeded small step): the same on every rank."""
    _, state = masters("llama", seed=0)
    for s in range(1, step + 1):
        state = small_step(state, lr=1e-2, seed=s)
    return state


class Trainer(Worker):
    """A trainer rank: the engine built as verl's `ActorRolloutRefWorker` builds it (`engine_kwargs` of
    the backend, `is_master` on rank 0), and `update_weights` handing it one full fp32 tensor at a
    time, as verl's `get_per_tensor_param` does."""

    def __init__(self, checkpoint_engine_config: CheckpointEngineConfig) -> None:
        super().__init__()
        config = checkpoint_engine_config
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend, is_master=self.rank == 0, bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}))
        self.masters = llama_masters(0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_to(self, step: int) -> None:
        self.masters = llama_masters(step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, float]:
        metrics: dict[str, float] = await self.checkpoint_engine.send_weights(
            iter(self.masters.items()), global_steps=global_steps)
        return metrics

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class ReceivingAdapter(BaseRollout):
    """verl's server adapter seam: keeps what `update_weights` was handed, and the `global_steps`
    the rollout server would label its tokens with."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.received: dict[str, torch.Tensor] = {}
        self.global_steps: int | None = None

    async def resume(self, tags: list[str]) -> None:
        raise NotImplementedError

    async def release(self) -> None:
        raise NotImplementedError

    async def update_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], global_steps: int | None = None,
                             **kwargs: Any) -> None:
        self.received = {name: tensor.clone() async for name, tensor in weights}
        self.global_steps = global_steps


class Rollout(CheckpointEngineWorker):
    """verl's own rollout-side worker, which builds the engine from the rollout config (importing
    `custom_backend_module`), with the adapter above."""

    def __init__(self, rollout_config: RolloutConfig, model_config: HFModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(rollout_config, model_config, ReceivingAdapter(rollout_config, model_config), *args,
                         **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def loaded(self) -> tuple[int | None, dict[str, torch.Tensor]]:
        adapter = self.server_adapter
        assert isinstance(adapter, ReceivingAdapter)
        return adapter.global_steps, adapter.received


class Replica(RolloutReplica):
    """A replica of rollout workers already started (no inference server: nothing to abort or resume)."""

    async def init_hybrid(self, worker_group: RayWorkerGroup) -> None:
        self.workers = worker_group.workers[self.world_size * self.replica_rank:
                                            self.world_size * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        raise NotImplementedError

    async def launch_servers(self) -> None:
        raise NotImplementedError
