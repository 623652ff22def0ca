"""Trainer and rollout workers for verl's `CheckpointEngineManager` under Ray, as verl's own test of its
checkpoint engines builds them (verl 0.9.1, tests/checkpoint_engine/test_utils.py: `TrainingWorkerTest`,
`CheckpointEngineWorkerTest` with its server adapter, `MockReplica`): a module Ray's worker processes
import by name. verl registers its training engines (FSDP, Megatron...) for CUDA and NPU devices only,
so the trainer ranks here hold a tiny Llama's fp32 masters sharded as FSDP2 holds them (DTensors over
a gloo process group) and hand them out as verl's FSDP engine does (`get_per_tensor_param`: each
gathered with `full_tensor()` as the generator reaches it, a collective every rank must join)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.utils.distributed import initialize_global_process_group_ray
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
    the backend, `is_master` on rank 0), `update_weights` handing it the masters one full fp32 tensor
    at a time."""

    def __init__(self, checkpoint_engine_config: CheckpointEngineConfig) -> None:
        super().__init__()
        config = checkpoint_engine_config
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend, is_master=self.rank == 0, bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}))
        initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
        self.mesh = init_device_mesh("cpu", (self.world_size,))
        self.train_to(0)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_to(self, step: int) -> None:
        """The masters after `step` steps, each rank holding its rows of each (a scalar whole)."""
        self.masters = {name: distribute_tensor(t, self.mesh, [Shard(0) if t.dim() else Replicate()])
                        for name, t in llama_masters(step).items()}

    def per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, p.full_tensor() if isinstance(p, DTensor) else p) for name, p in self.masters.items())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, float]:
        metrics: dict[str, float] = await self.checkpoint_engine.send_weights(self.per_tensor_param(),
                                                                              global_steps=global_steps)
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
