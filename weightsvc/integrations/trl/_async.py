"""TRL's `AsyncGRPOTrainer` on weightsvc, through the trainer's public doors alone.

    transfer = WeightsvcTransfer(target="weightsvc:50051", engine="http://vllm:8000", model="policy", rounding="sr")
    trainer = AsyncGRPOTrainer(model="/models/policy", reward_funcs=reward, args=AsyncGRPOConfig(...),
                               train_dataset=prompts, weight_transfer=transfer,
                               rollout_worker=transfer.rollouts(prompts, reward))
    transfer.attach(trainer)
    trainer.train()

- `weight_transfer=` (TRL's `WeightTransferProtocol`): each sync pushes the masters as the version of
  the trainer's global step (version 0 at train begin), or with `publish` publishes their served copy
  (a service started with `serve --nixl`; see `WeightsvcSync`); the engine, a `vllm serve` started with
  weightsvc's backend, stages it while it generates, is paused for the swap alone (TRL's `pause` is
  taken there), swaps it in through vLLM's RL API, and is resumed once it serves it; the version is
  acked to the service.
- `rollout_worker=` (TRL's `RolloutWorkerProtocol`, `WeightsvcRollouts`): completions from the engine's
  token-in/token-out route, with each token's log-probability and weight version. A sample's
  `model_version`, from which TRL reckons its staleness (and drops it past `max_staleness`), is that
  of its oldest token, not the version the request was sent under.
- `attach(trainer)`: a `TrainerCallback` stands the served copy of the last version in for the
  masters over each optimizer step's forwards and backwards (`served_weights`: a parametrization,
  gradients to the fp32 masters), and a forward hook on the model reads the log-probabilities the
  loss was computed with: each trained token's against the engine's, by the version that produced
  it, is the mismatch reported to the service after each step.

The hook reads the loss forward's packed layout (TRL's tree attention arguments `tree_kv_index` and
`tree_cu_seqlens_k`, `shift_labels`); a layout it cannot read raises. One training process: the
masters are pushed whole (FSDP ranks would push their shards, which is not wired here).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from weightsvc.client import InferenceClient, RolloutMismatch, rollout_mismatch, served_weights
from weightsvc.errors import subject
from weightsvc.integrations.fair_cast import served_state_dict
from weightsvc.integrations.trl._grpo import UNKNOWN_VERSION, WeightsvcSync, token_versions
from weightsvc.integrations.vllm.engine_api import EngineApi, EngineError
from weightsvc.integrations.vllm.follower import PAUSE_MODES
from weightsvc.protocol.lag import LagMetrics
from weightsvc.rounding import ExportSpec

__all__ = ["WeightsvcRollouts", "WeightsvcTransfer"]

BACKEND_HINT = "start it with --weight-transfer-config '{\"backend\": \"weightsvc\"}' (and VLLM_SERVER_DEV_MODE=1)"


@dataclass
class _Rollout:
    """One sample handed to the trainer, as the engine produced it: per token (prompt included, as
    the sample's `input_ids`), the engine's log-probability, the weight version and whether it is trained."""

    engine: np.ndarray
    versions: np.ndarray
    trained: np.ndarray
    model_version: int  # TRL's, of the oldest token


@dataclass
class _Scored:
    """One loss forward: the samples found in its packed row, the learner's log-probabilities of their
    tokens 1.. as the loss had them, and the forward's arguments (kept for the ablation)."""

    found: list[_Rollout]
    paths: list[torch.Tensor]  # each found sample's positions in the row
    learner: torch.Tensor
    kwargs: dict[str, Any] | None = None


class WeightsvcTransfer:
    """TRL's `WeightTransferProtocol` with weightsvc as the transport, and the served copy as what the
    loss is computed on. `target`: weightsvc's gRPC `host:port`; `engine`: the base URL of a `vllm
    serve` started with `--weight-transfer-config '{"backend": "weightsvc"}'`, `--enable-scale-out`
    and `--logprobs-mode processed_logprobs`, in dev mode (`VLLM_SERVER_DEV_MODE=1`), which no
    `weightsvc follow` drives besides; `model`: the weightsvc model. `format` / `rounding`
    override the service's export for this model's pushes (empty: the service's). `pause_mode`: what
    requests in flight do over the swap (vLLM's `keep`: they wait and go on with the new weights, so
    a completion may come from two versions). `publish`: each sync publishes the served copy the loss
    then runs on, exported with `spec` (the service's; None: that of the model's latest version), to a
    service started with `serve --nixl`, instead of pushing the masters (`WeightsvcSync`).
    `ablate_every` (0: never): every that many steps, the step's trained tokens of the newest version
    among them are scored again by the learner on that version's served copy, its fp32 masters and a
    round-to-nearest copy of them, each against the engine (`ablation`: three more no-grad forwards of
    the step's rows, and the masters of the last two versions held; a diagnostic, never reported)."""

    def __init__(self, target: str, engine: str, model: str = "default", *, format: str = "", rounding: str = "",
                 timeout_s: float = 120.0, update_timeout_s: float = 600.0, pause_mode: str = "keep",
                 client_id: str = "", ablate_every: int = 0, publish: bool = False,
                 spec: ExportSpec | None = None) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode {pause_mode!r}: one of {', '.join(PAUSE_MODES)}")
        self.sync = WeightsvcSync(target=target, engine=engine, model=model, format=format, rounding=rounding,
                                  on_policy=False, timeout_s=timeout_s, ablate_every=ablate_every, spec=spec,
                                  publish=publish)
        self.engine = EngineApi(engine, timeout_s)
        self.update_timeout_s = update_timeout_s
        self.pause_mode = pause_mode
        self.client_id = client_id or f"trl-{model}"
        self.pushed: dict[int, int] = {}  # weightsvc version -> TRL's model_version once it is served
        self._trainer: Any = None
        self._module: torch.nn.Module | None = None
        self._swapped: int | None = None  # the version swapped in, until the engine resumes on it
        self._rollouts: dict[tuple[int, ...], list[_Rollout]] = {}  # samples handed out, by their tokens
        self._lock = threading.Lock()
        self._served = contextlib.ExitStack()  # the served copy standing in, over one optimizer step
        self._in_step = False
        self._scored: list[_Scored] = []
        self._held: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}  # (masters, served)
        self._ablation: list[tuple[int, int, dict[str, RolloutMismatch]]] = []

    # -- what the learner reads ------------------------------------------------------------------------

    @property
    def model(self) -> str:
        return self.sync.model

    @property
    def version(self) -> int | None:
        """The last version pushed (the one the engine serves once TRL resumed it)."""
        return self.sync.version

    @property
    def lag(self) -> dict[int, LagMetrics]:
        return self.sync.lag

    @property
    def mismatch(self) -> list[tuple[int, dict[int, RolloutMismatch]]]:
        """Per optimizer step: the learner's log-probabilities of the step's trained tokens (on the served
        copy) against the engine's, by the version that produced each token; reported to the service."""
        return self.sync.mismatch

    @property
    def ablation(self) -> list[tuple[int, int, dict[str, RolloutMismatch]]]:
        """Per ablated step: the version whose tokens were scored again, and each copy's mismatch."""
        return self._ablation

    @property
    def served_from(self) -> str:
        return self.sync.served_from

    # -- set up ------------------------------------------------------------------------------------------

    def rollouts(self, train_dataset: Iterable[dict[str, Any]], reward_funcs: Callable[..., Any] | list[Any], *,
                 sampling_params: dict[str, Any] | None = None) -> WeightsvcRollouts:
        """The trainer's `rollout_worker`: completions of `train_dataset`'s prompts from the engine,
        scored by `reward_funcs` (as TRL's); `sampling_params` adds to those the trainer's config sets."""
        return WeightsvcRollouts(self, train_dataset, reward_funcs, sampling_params=sampling_params)

    def attach(self, trainer: Any) -> None:
        """Tie this transfer to `trainer` (an `AsyncGRPOTrainer` built with it): versions are its global
        steps, its loss runs on the served copy, and its loss forwards are read for the mismatch."""
        if trainer.accelerator.num_processes != 1:
            raise NotImplementedError(f"{trainer.accelerator.num_processes} training processes: WeightsvcTransfer "
                                      "pushes the masters of one process whole")
        if trainer.weight_transfer is not self:
            raise ValueError("attach: the trainer was not built with this WeightsvcTransfer as its weight_transfer")
        asked = str(trainer.args.vllm_server_base_url).rstrip("/")
        if trainer.args.token_budget is None and asked != self.engine.url:
            raise ValueError(f"AsyncGRPOConfig.vllm_server_base_url is {asked}, not the engine {self.engine.url}: "
                             "the trainer asks it for max_model_len (or set token_budget)")
        self._trainer = trainer
        self._module = trainer.accelerator.unwrap_model(trainer.model)
        self._module.register_forward_hook(self._on_forward, with_kwargs=True)
        trainer.add_callback(_ServedCopy(self))

    def attached(self) -> Any:
        if self._trainer is None:
            raise RuntimeError(f"model {self.model!r}: call WeightsvcTransfer.attach(trainer) before trainer.train()")
        return self._trainer

    # -- TRL's WeightTransferProtocol ------------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        self.attached()
        try:
            self.engine.post("/init_weight_transfer_engine", {"init_info": self._init_info()}, stage="connect")
        except EngineError as e:
            raise EngineError(e.stage, f"{e}: is the engine following weightsvc? {BACKEND_HINT}", e.status) from None

    def pause(self) -> None:
        """Nothing yet: the engine goes on generating while the masters are pushed and its workers stage
        them, and is paused for the swap alone (`send_weights`)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Push the masters (`iterator`: TRL's, read whole; or publish their served copy) as the version of
        the global step, then have the engine stage it, pause, and swap it in; `resume` lets it go on."""
        step = int(self.attached().state.global_step)
        masters = {name: tensor.detach() for name, tensor in iterator}
        self.sync.push(masters, step)
        self.engine.post("/init_weight_transfer_engine", {"init_info": self._init_info(stage=step)}, stage="stage")
        self.engine.post(f"/pause?mode={self.pause_mode}", stage="pause",
                         timeout_s=self.update_timeout_s if self.pause_mode == "wait" else None)
        try:
            self.engine.swap(step, self.update_timeout_s)
        except BaseException:
            with contextlib.suppress(EngineError):  # the engine keeps its weights: let it go on with them
                self.engine.post("/resume", stage="resume")
            raise
        self._swapped = step

    def resume(self) -> None:
        """Resume the engine on the version swapped in (its prefix cache, computed with the old weights,
        reset), check it serves that version, and ack it to the service."""
        version, self._swapped = self._swapped, None
        if version is None:
            return
        # TRL's model_version of the tokens from now on: it counts its syncs, and bumps it once this returns.
        self.pushed[version] = int(self.attached().model_version) + 1
        self.engine.post("/reset_prefix_cache", stage="resume")
        self.engine.post("/resume", stage="resume")
        served = self.engine.weight_version(stage="verify")
        if served != str(version):
            raise EngineError("verify", f"engine {self.engine.url} serves {served!r} after the swap of "
                              f"{subject(self.model, version)}")
        with InferenceClient(self.sync.target, timeout=self.sync.timeout_s) as client:
            client.ack(self.model, version, self.client_id)

    def destroy(self) -> None:
        self._leave()
        self.sync.close()

    def _init_info(self, **more: Any) -> dict[str, Any]:
        return {"target": self.sync.target, "model": self.model, **more}

    # -- the loss on the served copy, and what it saw ------------------------------------------------

    def model_version_of(self, versions: Iterable[int]) -> int:
        """TRL's `model_version` of a completion whose tokens came from weightsvc `versions`: that of the
        oldest (0, TRL's version before any sync, for a token of no version pushed here)."""
        return min((self.pushed.get(v, 0) for v in versions), default=0)

    def expect(self, sample: RolloutSample, engine: np.ndarray, versions: np.ndarray) -> None:
        """A sample handed to the trainer, whose loss forward will be read for the mismatch."""
        rollout = _Rollout(engine, versions, sample.completion_mask.astype(bool), sample.model_version)
        with self._lock:
            self._rollouts.setdefault(tuple(sample.input_ids.tolist()), []).append(rollout)

    def _enter(self) -> None:
        assert self._module is not None
        if self.sync.version is None:
            raise RuntimeError(f"model {self.model!r}: no version pushed before the first step")
        self._leave()  # (a step that never reached its optimizer: its copy is not stood in twice)
        self._served.enter_context(served_weights(self._module, self.sync.served))
        self._in_step = True

    def _leave(self) -> None:
        self._in_step = False
        self._served.close()

    def _on_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    output: Any) -> None:
        if not (self._in_step and kwargs.get("fused_lm_head")):
            return  # (a forward of ours, or one outside the loss)
        self._scored.append(self._match(kwargs, output.log_probs.detach()))

    def _match(self, kwargs: dict[str, Any], log_probs: torch.Tensor) -> _Scored:
        with self._lock:
            scored = read_row(kwargs, log_probs, self._rollouts)
        if self.sync.ablate_every:
            scored.kwargs = kwargs
        return scored

    def _step_done(self, step: int) -> None:
        """After the step's forwards and backwards, before the optimizer moves the masters: leave the served
        copy, report the step's mismatch by version, and ablate when due."""
        self._leave()
        scored, self._scored = self._scored, []
        rows = [r for s in scored for r in s.found]
        if rows:
            engine, versions, keep = _tokens(rows)
            learner = torch.cat([s.learner for s in scored])
            self.sync.report(step, rollout_mismatch(learner, engine, versions, mask=keep))
        if self.sync.ablate_every:
            self._hold()
            if rows and self.sync.ablation_due(step):
                self._ablate(step, scored, engine, versions, keep)
        self._forget_stale()

    def _hold(self) -> None:
        """The masters (still the version's: the optimizer has not stepped) and the served copy of the
        current version, beside the previous version's: the tokens a step trains are mostly a version
        behind."""
        assert self._module is not None and self.sync.version is not None
        version = self.sync.version
        if version not in self._held:
            masters = {n: t.detach().clone() for n, t in self._module.state_dict().items()}
            self._held = {v: c for v, c in self._held.items() if v >= version - 1}
            self._held[version] = (masters, self.sync.served)

    def _ablate(self, step: int, scored: list[_Scored], engine: torch.Tensor, versions: torch.Tensor,
                keep: torch.Tensor) -> None:
        """The step's trained tokens of the newest version held among them, scored again on that version's
        served copy, its fp32 masters and a round-to-nearest copy of them."""
        assert self._module is not None and self.sync.spec is not None
        present = [v for v in sorted(self._held, reverse=True) if bool((keep & (versions == v)).any())]
        if not present:
            return
        version = present[0]
        masters, served = self._held[version]
        rtn = served_state_dict(masters, dataclasses.replace(self.sync.spec, rounding="rtn"), version=version)
        learner = {}
        with torch.no_grad():
            for copy, values in (("served", served), ("masters", masters), ("rtn copy", rtn)):
                with served_weights(self._module, values):
                    learner[copy] = torch.cat([self._module(**s.kwargs).log_probs[0, path[:-1]]
                                               for s in scored if s.kwargs is not None for path in s.paths])
        mask = keep & (versions == version)
        self._ablation.append((step, version, {copy: rollout_mismatch(logps, engine, versions, mask=mask)[version]
                                               for copy, logps in learner.items()}))

    def _forget_stale(self) -> None:
        """Samples TRL can no longer train (staler than `max_staleness` already) are never scored: dropped."""
        trainer = self.attached()
        oldest = int(trainer.model_version) - int(trainer.args.max_staleness)
        with self._lock:
            for key in list(self._rollouts):
                kept = [r for r in self._rollouts[key] if r.model_version >= oldest]
                if kept:
                    self._rollouts[key] = kept
                else:
                    del self._rollouts[key]


def read_row(kwargs: dict[str, Any], log_probs: torch.Tensor, waiting: dict[tuple[int, ...], list[_Rollout]]
             ) -> _Scored:
    """The samples (taken out of `waiting`, by their tokens) of one packed row of the trainer's loss forward,
    and the learner's log-probabilities of their tokens 1..: each sample ends on a leaf of TRL's prefix
    trie, whose root-to-leaf path of positions (`tree_kv_index` between `tree_cu_seqlens_k` bounds) holds
    its tokens, and position i scores the sample's token i + 1 (`shift_labels`). Alike samples of one row
    share their leaf: they count once."""
    try:
        ids, labels = kwargs["input_ids"][0], kwargs["shift_labels"][0]
        kv, bounds = kwargs["tree_kv_index"], kwargs["tree_cu_seqlens_k"].tolist()
    except KeyError as e:
        raise RuntimeError(f"the trainer's loss forward has no {e}: not the packed layout of TRL's "
                           "AsyncGRPOTrainer this reads") from None
    found, paths, learner = [], [], []
    for s in range(len(bounds) - 1):
        path = kv[bounds[s]:bounds[s + 1]]
        key = tuple(ids[path].tolist())
        rollouts = waiting.get(key)
        if not rollouts:
            continue  # (a segment that ends at a branch)
        rollout = rollouts.pop(0)
        if not rollouts:
            del waiting[key]
        trained = torch.from_numpy(rollout.trained[1:])
        if not bool((labels[path[:-1]][trained] == ids[path[1:]][trained]).all()):
            raise RuntimeError("the loss forward's positions do not score the sample's tokens: TRL's packed "
                               "layout is not the one this reads")
        found.append(rollout)
        paths.append(path)
        learner.append(log_probs[0, path[:-1]])
    return _Scored(found, paths, torch.cat(learner) if learner else torch.empty(0))


def _tokens(rows: list[_Rollout]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine's log-probability, the version and whether it counts, of the samples' tokens 1.."""
    engine = torch.from_numpy(np.concatenate([r.engine[1:] for r in rows]).astype(np.float64))
    versions = torch.from_numpy(np.concatenate([r.versions[1:] for r in rows]))
    keep = torch.from_numpy(np.concatenate([r.trained[1:] for r in rows])) & (versions >= 0)
    return engine, versions, keep


class _ServedCopy(TrainerCallback):  # type: ignore[misc]
    """The served copy over each optimizer step's forwards and backwards; the step's mismatch after them."""

    def __init__(self, transfer: WeightsvcTransfer) -> None:
        self.transfer = transfer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.transfer._enter()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.transfer._step_done(int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.transfer._leave()


class WeightsvcRollouts:
    """TRL's `RolloutWorkerProtocol`: one completion per request from the engine's token-in/token-out route
    (`/inference/v1/generate`), `num_generations` per prompt, scored by the reward functions as TRL's
    own worker does (their sum; advantages normalized within the prompt's group). Each sample's
    `model_version` is that of its oldest token (`WeightsvcTransfer.model_version_of`). Prompts are
    text, or chat messages (the tokenizer's chat template); one turn, no tools. Runs in threads of the
    trainer's process, `max_inflight_tasks` requests at a time."""

    def __init__(self, transfer: WeightsvcTransfer, train_dataset: Iterable[dict[str, Any]],
                 reward_funcs: Callable[..., Any] | list[Any], *, sampling_params: dict[str, Any] | None = None
                 ) -> None:
        self.transfer = transfer
        self.dataset = train_dataset
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
        self.sampling_params = dict(sampling_params or {})
        self.rollout_buffer: queue.Queue[RolloutSample] = queue.Queue()
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue()
        self.model_version = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._requests: ThreadPoolExecutor | None = None
        self._failure: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._rows: Iterator[dict[str, Any]] = iter(())
        self._group = 0
        self._rng = random.Random(0)

    # -- TRL's RolloutWorkerProtocol -----------------------------------------------------------------------

    def start(self) -> None:
        args = self.transfer.attached().args
        self.rollout_buffer.maxsize = args.queue_maxsize  # (TRL took the queue at construction, before its args)
        self._rng = random.Random(args.seed)
        groups = max(1, args.max_inflight_tasks // args.num_generations)
        self._requests = ThreadPoolExecutor(groups * args.num_generations, thread_name_prefix="weightsvc-rollout")
        self._heartbeat = time.monotonic()
        self._threads = [threading.Thread(target=self._run, name=f"weightsvc-rollouts-{i}", daemon=True)
                         for i in range(groups)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.transfer.engine.timeout_s)
        if self._requests is not None:
            self._requests.shutdown(wait=False, cancel_futures=True)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._failure is not None:
            raise RuntimeError(f"rollouts from engine {self.transfer.engine.url} failed: {self._failure}") \
                from self._failure
        quiet = time.monotonic() - self._heartbeat
        if quiet > stale_after_s:
            raise RuntimeError(f"no completion from engine {self.transfer.engine.url} for {quiet:.0f} s")

    # -- the work --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                group, row = self._next_row()
                for sample in self._group_of(group, row):
                    while not self._stop.is_set():
                        try:
                            self.rollout_buffer.put(sample, timeout=0.5)  # (full: the trainer is behind)
                            break
                        except queue.Full:
                            continue
        except BaseException as e:  # told to the trainer by check_health
            self._failure = e

    def _next_row(self) -> tuple[int, dict[str, Any]]:
        with self._lock:
            row = next(self._rows, None)
            if row is None:  # (another pass over the prompts)
                self._rows = iter(self.dataset)
                row = next(self._rows)
            self._group += 1
            return self._group - 1, row

    def _group_of(self, group: int, row: dict[str, Any]) -> list[RolloutSample]:
        trainer = self.transfer.attached()
        args, tokenizer = trainer.args, trainer.processing_class
        prompt = row["prompt"]
        with self._lock:  # (one tokenizer, several threads)
            if isinstance(prompt, str):
                prompt_ids = list(tokenizer(prompt)["input_ids"])
            else:
                prompt_ids = list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False, **(args.chat_template_kwargs or {})))
            seeds = [self._rng.getrandbits(63) for _ in range(args.num_generations)]
        assert self._requests is not None
        outs = [o for o in self._requests.map(lambda seed: self._generate(prompt_ids, seed, args), seeds) if o[0]]
        if not outs:
            return []
        completion_ids = [ids for ids, _, _ in outs]
        with self._lock:
            texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions: list[Any] = texts if isinstance(prompt, str) else [
            [{"role": "assistant", "content": t}] for t in texts]
        rewards, by_func = self._rewards(row, prompt, completions, completion_ids)
        scored = ~np.isnan(rewards)
        advantages = np.zeros_like(rewards)
        if scored.any():
            advantages[scored] = (rewards[scored] - rewards[scored].mean()) / (rewards[scored].std() + 1e-8)
        reward_std = float(rewards[scored].std()) if scored.any() else math.nan
        samples = []
        for i, (ids, logps, versions) in enumerate(outs):
            n = len(prompt_ids)
            sample = RolloutSample(
                prompt=prompt, completion=completions[i],
                input_ids=np.asarray(prompt_ids + ids, dtype=np.int64),
                completion_mask=np.asarray([0] * n + [1] * len(ids), dtype=np.int64),
                old_log_probs=np.asarray([0.0] * n + logps, dtype=np.float32),
                advantage=float(advantages[i]), model_version=self.transfer.model_version_of(versions),
                group_id=group,
                metrics={"reward": float(rewards[i]), "reward_std": reward_std,
                         **{f"rewards/{name}": float(r[i]) for name, r in by_func.items()}})
            self.transfer.expect(sample, np.asarray([0.0] * n + logps),
                                 np.asarray([UNKNOWN_VERSION] * n + versions, dtype=np.int64))
            samples.append(sample)
        self.metrics_queue.put({"rollout/weight_versions_per_completion":
                                sum(len(set(v)) for _, _, v in outs) / len(outs)})
        return samples

    def _generate(self, prompt_ids: list[int], seed: int, args: Any) -> tuple[list[int], list[float], list[int]]:
        """One completion: its token ids, their log-probabilities and weight versions."""
        params = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                  "repetition_penalty": args.repetition_penalty, "max_tokens": args.max_completion_length,
                  "logprobs": 0, "seed": seed, **({"min_p": args.min_p} if args.min_p is not None else {}),
                  **self.sampling_params}
        out = self.transfer.engine.post("/inference/v1/generate", {"token_ids": prompt_ids, "sampling_params": params},
                                        stage="rollout", timeout_s=float(args.request_timeout))
        choice = out["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logps = [float(t["logprob"]) for t in choice["logprobs"]["content"]]
        if len(logps) != len(ids):
            raise EngineError("rollout", f"engine {self.transfer.engine.url}: {len(ids)} tokens, {len(logps)} "
                              "log-probabilities")
        self._heartbeat = time.monotonic()
        return ids, logps, token_versions(choice.get("weight_versions"), len(ids))

    def _rewards(self, row: dict[str, Any], prompt: Any, completions: list[Any],
                 completion_ids: list[list[int]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The sum of the reward functions of each completion (NaN where every one said None), and each's."""
        n = len(completions)
        extra = {k: [v] * n for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        by_func = {}
        for func in self.reward_funcs:
            out = func(prompts=[prompt] * n, completions=completions, completion_ids=completion_ids, **extra)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            by_func[getattr(func, "__name__", type(func).__name__)] = np.asarray(
                [math.nan if r is None else float(r) for r in out], dtype=float)
        columns = np.stack(list(by_func.values()))
        rewards = np.nansum(columns, axis=0)
        rewards[np.isnan(columns).all(axis=0)] = math.nan
        return rewards, by_func


async def _awaited(value: Any) -> Any:
    return await value
