"""verl: a checkpoint engine named "weightsvc" that syncs trainer -> rollout through a weightsvc service,
and verl's rollout correction with the trainer-rollout mismatch reported by weight version.

Written against verl 0.9.1 (`verl/checkpoint_engine/base.py`); verl is imported with this module: it
is the `verl` extra. verl's `CheckpointEngineManager.update_weights(global_steps)` drives every engine:
`prepare()` on each trainer and rollout worker, `build_topology(trainer_world_size,
rollout_world_size, metadata)`, `init_process_group(**kwargs)` per worker, then the trainer workers'
`send_weights(per_tensor_param, global_steps=...)` while each rollout worker's server adapter consumes
`receive_weights(global_steps=...)`, then `finalize()`. The trainer's engines are built with
`is_master` and `bucket_size`, the rollout's with `bucket_size`, both with
`rollout.checkpoint_engine.engine_kwargs.weightsvc`.

The version of an update is verl's `global_steps`: the rollout servers label what they generate with
it (`min_global_steps` / `max_global_steps` of each trajectory), so those labels are weightsvc versions
and the mismatch can be reported by version (`rollout_correction`). verl updates again with the same
`global_steps` (validation, critic warm-up): the masters are then unchanged and the push is the
service's idempotent re-push. An update without `global_steps` re-pushes the latest version (version 0
before any). A run resumed from a checkpoint older than the model's latest version pushes steps the
service already holds with other content, which it refuses: resume onto a fresh model name.

verl's FSDP engine hands every trainer rank the same full fp32 tensors (`DTensor.full_tensor`), so
the ranks split them, whole tensors balanced by bytes, and push their shares as one multi-rank push:
the version commits when all ranks are in (nothing visible otherwise), exported by the service's
rounding. Each rollout worker waits for that version, pulls the served copy (checksums verified),
yields `(name, tensor)` and acks it.

Enable: `pip install 'weightsvc[verl]'` (verl loads the backend through its `verl.plugins` entry
point), then

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsvc
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsvc.target=weightsvc:50051

verl's rollout adapters cast what they receive to `rollout.dtype`: serve a format of that dtype (bf16).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

from weightsvc.client import InferenceClient, LearnerClient, RolloutMismatch, rollout_mismatch
from weightsvc.errors import NotFound, subject

log = logging.getLogger("weightsvc.verl")

BACKEND = "weightsvc"
UNKNOWN_VERSION = -1  # a token whose weight version verl did not record (see `token_versions`)
__all__ = ["BACKEND", "WeightsvcCheckpointEngine", "rollout_correction", "split_by_bytes", "token_versions"]


@CheckpointEngineRegistry.register(BACKEND)
class WeightsvcCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine over a weightsvc service.

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
        # From `init_process_group`: a trainer worker's rank among the trainer's (-1 on the rollout) and
        # the model's latest version when the update began (None: nothing committed yet).
        self.rank, self.world_size = -1, 1
        self.latest: int | None = None
        self._joined = False
        # What a rollout worker acks as (`weightsvc status` lists it): one id for the engine's life.
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
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
                       ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """The trainer workers their rank among them; every worker the latest version any saw."""
        seen = [m["latest"] for m in metadata if m and m.get("latest") is not None]
        latest = max(seen) if seen else None
        trainers, rollouts = actor_wg_world_size, rollout_world_size
        trainer: dict[str, list[Any]] = {"rank": list(range(trainers)), "world_size": [trainers] * trainers,
                                         "latest": [latest] * trainers}
        rollout: dict[str, list[Any]] = {"rank": [-1] * rollouts, "world_size": [trainers] * rollouts,
                                         "latest": [latest] * rollouts}
        return trainer, rollout

    # (verl declares `**kwargs`: each engine takes the keywords its own `build_topology` hands out)
    def init_process_group(self, rank: int, world_size: int, latest: int | None) -> None:  # type: ignore[override]
        self.rank, self.world_size, self.latest, self._joined = rank, world_size, latest, True

    def finalize(self) -> None:
        """Nothing is held between updates: each push and pull opens its own connection."""
        self._joined = False

    async def send_weights(self, weights: Iterable[tuple[str, Any]], global_steps: int | None = None
                           ) -> dict[str, float]:
        """Push this rank's share of the masters as the update's version; returns once it commits,
        with the metrics verl merges into the step's (`weightsvc/version`)."""
        version = self._version(global_steps, "send_weights")
        if self.rank < 0:
            raise RuntimeError(f"{subject(self.model, version)}: send_weights on a rollout worker (rank -1)")
        share = split_by_bytes(weights, self.rank, self.world_size)
        with LearnerClient(self.target, token=self.token, timeout=self.timeout_s) as learner:
            info = await asyncio.to_thread(learner.push, version, share, self.model, rank=self.rank,
                                           world_size=self.world_size, format=self.format, rounding=self.rounding,
                                           tied=self.tied)
        log.info("%s pushed by rank %d of %d (%d tensors%s)", subject(self.model, info.version), self.rank,
                 self.world_size, len(share), "" if info.created else "; the same masters as before")
        return {"weightsvc/version": float(info.version)}

    # (verl annotates the coroutine; its engines, as this one, are async generators)
    async def receive_weights(  # type: ignore[override]
            self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Wait for the update's version, pull its served copy and yield `(name, tensor)`; acks it."""
        version = self._version(global_steps, "receive_weights")
        with InferenceClient(self.target, token=self.token, timeout=self.timeout_s) as client:
            weights = await asyncio.wait_for(asyncio.to_thread(self._pull_when_committed, client, version),
                                             self.timeout_s)
            for name, tensor in weights.items():
                yield name, tensor
            client.ack(self.model, version, self.client_id)
        log.info("%s received (%d tensors)", subject(self.model, version), len(weights))

    def _version(self, global_steps: int | None, call: str) -> int:
        if not self._joined:
            raise RuntimeError(f"model {self.model!r}: {call} before init_process_group joined this worker "
                               "to the update")
        if global_steps is not None:
            return int(global_steps)
        return self.latest if self.latest is not None else 0

    def _pull_when_committed(self, client: InferenceClient, version: int) -> dict[str, torch.Tensor]:
        for info in client.watch(self.model, after=version - 1):
            if info.version >= version:
                return client.pull(self.model, version)
        raise RuntimeError(f"{subject(self.model, version)}: the watch ended before the version committed")


def split_by_bytes(weights: Iterable[tuple[str, Any]], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of the full tensors every rank iterates in the same order: each tensor goes
    whole to the rank with the fewest bytes so far (the lowest on ties), so the shares are disjoint,
    cover every tensor, and weigh about the same. Each is copied to the CPU as it comes (verl's
    generator may reuse its device buffers); the rest are only iterated, which every rank must do (the
    generator gathers each tensor from all ranks)."""
    loads = [0] * world_size
    share: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor: gathered here
        owner = loads.index(min(loads))
        loads[owner] += full.numel() * full.element_size()
        if owner == rank:
            share[name] = full.detach().to("cpu", copy=True)
    return share


# ---- the trainer's rollout correction, by weight version ------------------------------------------


def token_versions(batch: DataProto) -> torch.Tensor:
    """The weight version of each response token of `batch` ([batch, response length]), from the
    versions verl records per trajectory: every token of one generated under a single version
    (`min_global_steps` == `max_global_steps`) has it. A trajectory resumed across updates (partial
    rollout) spans several and verl keeps only the first and the last, so its tokens are
    `UNKNOWN_VERSION`, as are those of a trajectory without a record."""
    mask = batch.batch["response_mask"]
    rows = len(batch)
    first = batch.non_tensor_batch.get("min_global_steps", np.full(rows, None, dtype=object))
    last = batch.non_tensor_batch.get("max_global_steps", np.full(rows, None, dtype=object))
    per_row = [int(a) if a is not None and a == b else UNKNOWN_VERSION for a, b in zip(first, last, strict=True)]
    return torch.tensor(per_row, dtype=torch.long).unsqueeze(1).expand(mask.shape).clone()


def rollout_correction(batch: DataProto, config: Any, *, learner: LearnerClient | None = None,
                       model: str = "default", step: int | None = None
                       ) -> tuple[DataProto, dict[str, float], dict[int, RolloutMismatch]]:
    """verl's rollout correction of `batch`, and its trainer-rollout mismatch by weight version.

    `config` is verl's `algorithm.rollout_correction` (`rollout_is`: "token" or "sequence",
    `rollout_is_threshold`: TIS's upper bound or IcePop's "low_high", `rollout_rs`...): the batch's
    `rollout_is_weights` and `response_mask` are verl's own (`compute_rollout_correction_and_add_to_batch`
    on `old_log_probs` and `rollout_log_probs`). Each token's weight, exp(old - rollout), is divided
    by the probability under the version that sampled it: its rollout log-probability is that
    version's. The mismatch (`rollout_mismatch`, token means) is taken over the tokens the
    correction keeps whose version is known (`token_versions`), and reported to the service with
    `learner` as step `step`. Returns the batch, verl's metrics plus `weightsvc/unversioned_tokens`,
    and the mismatch by version."""
    batch, metrics = compute_rollout_correction_and_add_to_batch(batch, config)
    versions = token_versions(batch)
    kept = batch.batch["response_mask"].detach().cpu().bool()
    by_version = rollout_mismatch(batch.batch["old_log_probs"].detach().cpu(),
                                  batch.batch["rollout_log_probs"].detach().cpu(), versions,
                                  mask=kept & (versions != UNKNOWN_VERSION))
    metrics["weightsvc/unversioned_tokens"] = float((kept & (versions == UNKNOWN_VERSION)).sum())
    if learner is not None and by_version:
        learner.report_mismatch(model, by_version, step=step)
    return batch, metrics, by_version
