"""verl's `CheckpointEngineManager` syncing trainer -> rollout workers under Ray (on the CPU) through the
"weightsvc" backend, as verl's own test of its checkpoint engines runs (verl 0.9.1,
tests/checkpoint_engine/test_correctness_on_gpu.py: trainer and rollout worker groups, replicas, the
manager's `update_weights` three times).

Every part of verl is verl's: the Ray worker groups and their dispatch, the manager, the rollout's
`CheckpointEngineWorker` building the engine from the rollout config. Ours: trainer ranks holding a
tiny Llama's fp32 masters sharded as FSDP2 shards them (verl registers its training engines for CUDA
and NPU only: `tests/verl/workers.py`), and a server adapter that keeps what it was handed. verl's
vLLM rollout (`vLLMReplica`) cannot take its place: its servers are placed by the CUDA devices of
their workers (standalone replicas ask Ray for GPUs), and verl 0.9.1 takes transformers < 5.11 where
vLLM for the CPU (0.32) takes >= 5.16.1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from verl.checkpoint_engine import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

from tests.conftest import serving
from tests.engines.engines import checkpoint, masters
from tests.helpers import assert_served, same_bits
from tests.verl.workers import Replica, Rollout, Trainer, llama_masters
from weightsvc import InferenceClient

TRAINERS, ROLLOUTS = 2, 2


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # Ray's CPUs are slots, not cores: one per worker process (each takes one of its pool's bundles).
    ray.init(num_cpus=TRAINERS + ROLLOUTS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def worker_group(cls: type, count: int, **kwargs: Any) -> RayWorkerGroup:
    pool = RayResourcePool(process_on_nodes=[count], use_gpu=False, max_colocate_count=1)
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(cls), **kwargs),
                          device_name="cpu")


def test_the_manager_updates_rollout_workers_through_weightsvc(local_ray: None, model: str, tmp_path: Path) -> None:
    module, _ = masters("llama", seed=0)
    model_config = HFModelConfig(path=str(checkpoint(module, tmp_path / "policy")), load_tokenizer=False)
    with serving() as srv:
        config = CheckpointEngineConfig(backend="weightsvc", engine_kwargs={
            "weightsvc": {"target": srv.grpc_target, "model": model, "timeout_s": 120.0}})
        rollout_config = RolloutConfig(name="vllm", checkpoint_engine=config)
        trainer = worker_group(Trainer, TRAINERS, checkpoint_engine_config=config)
        rollout = worker_group(Rollout, ROLLOUTS, rollout_config=rollout_config, model_config=model_config)
        replicas = [Replica(replica_rank=r, config=rollout_config, model_config=model_config)
                    for r in range(ROLLOUTS)]  # one worker each (tensor parallel 1)

        async def start() -> None:
            await asyncio.gather(*(r.init_hybrid(rollout) for r in replicas))

        asyncio.run(start())
        manager = CheckpointEngineManager(config=config, actor_wg=trainer, replicas=replicas)

        for step in (0, 1, 2):  # as verl's trainer: the starting masters at step 0, then one update per step
            trainer.train_to(step)
            assert manager.update_weights(global_steps=step) == {"weightsvc/version": float(step)}
            loaded = rollout.loaded()
            assert [steps for steps, _ in loaded] == [step] * ROLLOUTS  # what the servers label tokens with
            assert_served(loaded[0][1], llama_masters(step), step)
            same_bits(loaded[0][1], loaded[1][1])

        with InferenceClient(srv.grpc_target) as client:
            assert [v.version for v in client.versions(model)] == [0, 1, 2]
            acks = sorted(c.version for c in client.clients(model))
            assert acks == [2] * ROLLOUTS  # each rollout worker's engine, kept across updates, acked the last
