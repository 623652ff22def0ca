"""verl: a checkpoint engine named "weightsvc" that syncs trainer -> rollout through a weightsvc service.

Written against verl 0.8.0.dev (volcengine/verl b178a3cd, `verl/checkpoint_engine/base.py`). verl
builds each engine with `CheckpointEngineRegistry.new(backend, **kwargs)` (the trainer's with
`is_master` and `bucket_size`, the rollout's with `bucket_size`, both with
`rollout.checkpoint_engine.engine_kwargs.weightsvc`), then on each update: `prepare()` on every worker,
`build_topology(trainer_world_size, rollout_world_size, metadata)`, `init_process_group(**kwargs)` per
worker, the trainer's `send_weights(generator)` while the rollout's `receive_weights()` feeds the
server adapter, and `finalize()`.

Here: every worker's `prepare` reports the model's latest version, `build_topology` numbers the update
(the latest + 1, so a resumed run goes on numbering) and gives every worker that version and the
trainer ranks their rank. verl's FSDP engine hands every trainer rank the same full fp32 tensors
(`DTensor.full_tensor`), so the ranks split them, whole tensors balanced by bytes, and push their
shares as one multi-rank push: the version commits when all ranks are in (nothing visible otherwise),
exported by the service's rounding. The rollout side waits for that version, pulls the served copy
(checksums verified), yields `(name, tensor)` and acks it.

Enable (both the trainer's and the rollout's processes must import this module, which registers the
backend when verl is importable):

    VERL_USE_EXTERNAL_MODULES=weightsvc.integrations.verl
    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsvc
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsvc.target=weightsvc:50051

The rollout adapter casts what it receives to `rollout.dtype`: serve a format of that dtype (bf16).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from weightsvc.client import InferenceClient, LearnerClient
from weightsvc.errors import NotFound

log = logging.getLogger("weightsvc.verl")

BACKEND = "weightsvc"
__all__ = ["BACKEND", "WeightsvcEngine", "register"]


class WeightsvcEngine:
    """The backend's behaviour; `register` makes it a subclass of verl's `CheckpointEngine`.

    `target`: the service (gRPC HOST:PORT); `model`: the model name in it; `format`, `rounding`: the
    export of each push (empty: the service's); `token`: a bearer token (push role on the trainer);
    `timeout_s`: how long the rollout waits for the trainer's version; `tied`: declared ties (alias ->
    tensor), as `LearnerClient.push` takes them; `client_id`: what a rollout worker acks as."""

    def __init__(self, bucket_size: int = 0, is_master: bool = False, *, target: str = "127.0.0.1:50051",
                 model: str = "default", format: str = "", rounding: str = "", token: str | None = None,
                 timeout_s: float = 600.0, tied: Mapping[str, str] | None = None, client_id: str | None = None
                 ) -> None:
        self.bucket_size = bucket_size  # (verl's bucket: the service streams in chunks of its own)
        self.is_master = is_master
        self.target, self.model, self.format, self.rounding = target, model, format, rounding
        self.token, self.timeout_s, self.tied = token, timeout_s, dict(tied or {})
        self.rank, self.world_size, self.version = -1, 1, -1  # from `init_process_group`
        # What the rollout worker acks as (`weightsvc status` lists it): one id for the engine's life.
        self.client_id = client_id or f"verl-{socket.gethostname()}-{os.getpid()}-{id(self):x}"

    # ---- the lifecycle verl drives ------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """This worker's view of the model's latest version (None: nothing committed yet)."""
        with InferenceClient(self.target, token=self.token, timeout=self.timeout_s) as client:
            try:
                return {"latest": client.manifest(self.model, "latest").version}
            except NotFound:
                return {"latest": None}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
                       ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every worker gets the version of this update; the trainer's ranks their rank among them."""
        seen = [m["latest"] for m in metadata if m and m.get("latest") is not None]
        version = max(seen) + 1 if seen else 1
        trainer = {"rank": list(range(trainer_world_size)), "world_size": [trainer_world_size] * trainer_world_size,
                   "version": [version] * trainer_world_size}
        rollout = {"rank": [-1] * rollout_world_size, "world_size": [trainer_world_size] * rollout_world_size,
                   "version": [version] * rollout_world_size}
        return trainer, rollout

    def init_process_group(self, rank: int, world_size: int, version: int) -> None:
        self.rank, self.world_size, self.version = rank, world_size, version

    def finalize(self) -> None:
        """Nothing is held between updates: each push and pull opens its own connection."""

    async def send_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Push this rank's share of the masters as version `self.version`; returns once it commits."""
        if self.rank < 0:
            raise RuntimeError("send_weights before init_process_group gave this trainer worker its rank")
        share = split_by_bytes(weights, self.rank, self.world_size)
        with LearnerClient(self.target, token=self.token, timeout=self.timeout_s) as learner:
            info = await asyncio.to_thread(learner.push, self.version, share, self.model, rank=self.rank,
                                           world_size=self.world_size, format=self.format, rounding=self.rounding,
                                           tied=self.tied)
        log.info("model %s version %d pushed by rank %d of %d (%d tensors)", self.model, info.version, self.rank,
                 self.world_size, len(share))

    async def receive_weights(self) -> AsyncIterator[tuple[str, Any]]:
        """Wait for version `self.version`, pull its served copy and yield `(name, tensor)`; acks it."""
        if self.version < 0:
            raise RuntimeError("receive_weights before init_process_group gave this rollout worker the version")
        with InferenceClient(self.target, token=self.token, timeout=self.timeout_s) as client:
            weights = await asyncio.wait_for(asyncio.to_thread(self._pull_when_committed, client), self.timeout_s)
            for name, tensor in weights.items():
                yield name, tensor
            client.ack(self.model, self.version, self.client_id)
        log.info("model %s version %d received (%d tensors)", self.model, self.version, len(weights))

    def _pull_when_committed(self, client: InferenceClient) -> dict[str, Any]:
        for info in client.watch(self.model, after=self.version - 1):
            if info.version >= self.version:
                return client.pull(self.model, self.version)
        raise RuntimeError(f"model {self.model!r}: the watch ended before version {self.version}")


def split_by_bytes(weights: Iterable[tuple[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """Rank `rank`'s share of the full tensors every rank iterates in the same order: each tensor goes
    whole to the rank with the fewest bytes so far (the lowest on ties), so the shares are disjoint,
    cover every tensor, and weigh about the same. Each is copied to the CPU as it comes (verl's
    generator may reuse its device buffers); the rest are only iterated, which every rank must do (the
    generator gathers each tensor from all ranks)."""
    loads = [0] * world_size
    share: dict[str, Any] = {}
    for name, tensor in weights:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor: gathered here
        owner = loads.index(min(loads))
        loads[owner] += full.numel() * full.element_size()
        if owner == rank:
            share[name] = full.detach().to("cpu", copy=True)
    return share


def register() -> type | None:
    """Register the backend with verl's `CheckpointEngineRegistry`; None (nothing done) without verl."""
    try:
        from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    except ImportError:
        return None
    engine = type("WeightsvcCheckpointEngine", (WeightsvcEngine, CheckpointEngine), {"__module__": __name__})
    CheckpointEngineRegistry.register(BACKEND)(engine)
    return engine


WeightsvcCheckpointEngine = register()  # on import: verl imports this module in each of its processes
