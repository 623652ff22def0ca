"""A stand-in for `verl.checkpoint_engine` (verl needs Ray and GPUs; it cannot run here).

The signatures are those of volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7
(2026-01-29, version 0.8.0.dev), `verl/checkpoint_engine/base.py`: `CheckpointEngineRegistry`
(`register`, `get`, `new`) and the abstract `CheckpointEngine`. `update_weights` follows, in one
process, what that commit's `CheckpointEngineManager.update_weights` and the workers do with an engine:
how `engine_workers.py` (trainer) and `CheckpointEngineWorker` (rollout) build it, then prepare,
build_topology, init_process_group, send/receive (the rollout's server adapter consuming the
generator with `async for`, as `ensure_async_iterator` does), finalize. Only the signatures and that
order are copied; the bodies are written for the test.
"""

from __future__ import annotations

import asyncio
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch


class CheckpointEngineRegistry:
    _registry: ClassVar[dict[str, type[CheckpointEngine]]] = {}

    def register(backend: str):  # type: ignore[no-untyped-def,misc]  # (verl's: a plain function on the class)
        def wrapper(cls: type[CheckpointEngine]) -> type[CheckpointEngine]:
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str) -> type[CheckpointEngine]:
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args: Any, **kwargs: Any) -> CheckpointEngine:
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered")
        return cls._registry[backend](*args, **kwargs)


class CheckpointEngine(ABC):
    @abstractmethod
    def prepare(self) -> dict[str, Any]: ...

    @classmethod
    @abstractmethod
    def build_topology(
        cls, trainer_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]: ...

    @abstractmethod
    def init_process_group(self, **kwargs): ...  # type: ignore[no-untyped-def]

    @abstractmethod
    def finalize(self): ...  # type: ignore[no-untyped-def]

    @abstractmethod
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]): ...  # type: ignore[no-untyped-def]

    @abstractmethod
    async def receive_weights(self) -> Generator[tuple[str, torch.Tensor], None, None]: ...  # type: ignore[misc]


@contextmanager
def installed() -> Iterator[type[CheckpointEngineRegistry]]:
    """`verl` and `verl.checkpoint_engine` importable as this stand-in, for the block only."""
    saved = {name: sys.modules.get(name) for name in ("verl", "verl.checkpoint_engine")}
    verl = types.ModuleType("verl")
    engine = types.ModuleType("verl.checkpoint_engine")
    engine.CheckpointEngine = CheckpointEngine  # type: ignore[attr-defined]
    engine.CheckpointEngineRegistry = CheckpointEngineRegistry  # type: ignore[attr-defined]
    verl.checkpoint_engine = engine  # type: ignore[attr-defined]
    sys.modules.update({"verl": verl, "verl.checkpoint_engine": engine})
    CheckpointEngineRegistry._registry.clear()
    try:
        yield CheckpointEngineRegistry
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


async def update_weights(backend: str, trainers: list[CheckpointEngine], rollouts: list[CheckpointEngine],
                         per_tensor_param: Callable[[], Iterator[tuple[str, torch.Tensor]]]
                         ) -> list[dict[str, torch.Tensor]]:
    """One update as verl runs it; returns what each rollout worker's server adapter received."""
    cls = CheckpointEngineRegistry.get(backend)
    metadata = [e.prepare() for e in trainers + rollouts]
    trainer_kwargs, rollout_kwargs = cls.build_topology(len(trainers), len(rollouts), metadata)
    for kwargs, workers in ((trainer_kwargs, trainers), (rollout_kwargs, rollouts)):
        for k, v in kwargs.items():
            assert len(v) == len(workers), f"{k} must have one value per worker"
        for i, e in enumerate(workers):
            e.init_process_group(**{k: v[i] for k, v in kwargs.items()})

    async def adapter(e: CheckpointEngine) -> dict[str, torch.Tensor]:
        return {name: t async for name, t in e.receive_weights()}  # type: ignore[attr-defined]

    received = await asyncio.gather(*(e.send_weights(per_tensor_param()) for e in trainers),
                                    *(adapter(e) for e in rollouts))
    for e in trainers + rollouts:
        e.finalize()
    return list(received[len(trainers):])
