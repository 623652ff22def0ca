"""The "weightsvc" verl checkpoint engine against a real service, driven as verl drives its backends.

verl cannot run here (Ray, GPUs): `verl_standin` mirrors the registry and the abstract engine of
volcengine/verl commit b178a3cd56f58b2d502255daba591e92833930a7 (0.8.0.dev) and the order in which
its manager and workers call an engine. Two trainer ranks push (each its share), two rollout
workers receive the served copy, bit for bit the service's export of the masters.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from tests.conftest import make_masters, serving
from tests.helpers import assert_served, same_bits, small_step
from tests.integration import verl_standin as standin
from weightsvc import InferenceClient
from weightsvc.integrations import verl as integration
from weightsvc.integrations.verl import split_by_bytes

BUCKET = 2048 << 20  # verl's default update_weights_bucket_megabytes, as verl passes it


def engines(registry: type[standin.CheckpointEngineRegistry], trainers: int, rollouts: int, **kwargs: object
            ) -> tuple[list[standin.CheckpointEngine], list[standin.CheckpointEngine]]:
    """Built as verl builds them: the trainer's in engine_workers.py, the rollout's in CheckpointEngineWorker."""
    return ([registry.new("weightsvc", is_master=r == 0, bucket_size=BUCKET, **kwargs) for r in range(trainers)],
            [registry.new("weightsvc", bucket_size=BUCKET, **kwargs) for _ in range(rollouts)])


def test_trainer_ranks_push_and_rollouts_receive_the_served_copy(model: str) -> None:
    with serving() as srv, standin.installed() as registry:
        cls = integration.register()
        assert cls is not None and registry.get("weightsvc") is cls
        assert issubclass(cls, standin.CheckpointEngine) and not cls.__abstractmethods__
        masters = make_masters(seed=5)
        for step in (1, 2):  # new engines each time: a restarted trainer goes on numbering from the service
            trainers, rollouts = engines(registry, 2, 2, target=srv.grpc_target, model=model)
            received = asyncio.run(standin.update_weights("weightsvc", trainers, rollouts,
                                                          lambda m=masters: iter(m.items())))  # type: ignore[misc]
            assert_served(received[0], masters, step)
            same_bits(received[0], received[1])
            masters = small_step(masters, lr=1e-2, seed=step)
        with InferenceClient(srv.grpc_target) as client:
            assert [v.version for v in client.versions(model)] == [1, 2]
            # each rollout worker acked what it loaded (the engines of each update are new: four clients)
            assert sorted(c.version for c in client.clients(model)) == [1, 1, 2, 2]


def test_a_worker_that_was_given_no_version_refuses(model: str) -> None:
    with standin.installed() as registry:
        integration.register()
        trainer, rollout = (e[0] for e in engines(registry, 1, 1, target="127.0.0.1:1", model=model))
        with pytest.raises(RuntimeError, match="before init_process_group"):
            asyncio.run(trainer.send_weights(iter([])))

        async def first() -> object:
            return await anext(rollout.receive_weights())  # type: ignore[attr-defined]

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


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed here")
def test_without_verl_nothing_is_registered() -> None:
    assert integration.register() is None
