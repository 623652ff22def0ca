"""`GRPOTrainer` on weightsvc (`FairCastGRPOTrainer`, `WeightsvcSync`): the learner pushes its fp32 masters
(or, with `publish`, publishes their served copy) after each optimizer step, rollouts come from a `vllm
serve` that follows weightsvc (`weightsvc follow`), and the loss is computed on the served copy (Fair Cast).

TRL 1.16 applies its vLLM importance-sampling correction (the engine's per-token log-probabilities
against the learner's) only with `use_vllm`, which loads vLLM into the trainer's process and moves
the weights itself over NCCL. Here weightsvc moves them and the engine is reached over HTTP, so the
trainer takes the correction path with the engine's log-probabilities that `rollout_func` returns:
this needs TRL's private `_generate_and_score_completions` (the batch with both log-probabilities)
and `_get_per_token_logps_and_entropies` (the ablation's forwards), and its `use_vllm` /
`vllm_generation` attributes. `AsyncGRPOTrainer` has public doors for all of it (`WeightsvcTransfer`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback
from trl import GRPOTrainer

from weightsvc.client import InferenceClient, LearnerClient, RankLag, RolloutMismatch, rollout_mismatch, served_weights
from weightsvc.errors import NotFound, WeightsvcError, subject
from weightsvc.integrations.fair_cast import ServedMismatch, check_served, masters_digest_of, served_state_dict
from weightsvc.integrations.vllm.engine_api import EngineApi
from weightsvc.protocol.lag import LagMetrics
from weightsvc.rounding import ExportSpec, Residual

__all__ = ["FairCastGRPOTrainer", "WeightsvcSync", "token_versions"]

# The first versions (the starting masters, whose bits any rounding serves as they are, and the first
# step) are checked against the service's checksums before the learner trusts its own copy.
CHECKED_VERSIONS = 2
UNKNOWN_VERSION = -1  # a token whose engine weights carried no weightsvc version label


def token_versions(spans: list[dict[str, Any]] | None, length: int) -> list[int]:
    """The weight version of each output token from vLLM's `weight_versions` spans (`[start, end)`)."""
    versions = [UNKNOWN_VERSION] * length
    for span in spans or []:
        label = str(span["version"])
        version = int(label) if label.isdigit() else UNKNOWN_VERSION
        for i in range(int(span["start"]), min(int(span["end"]), length)):
            versions[i] = version
    return versions


@dataclass
class WeightsvcSync:
    """Where the masters go and the rollouts come from.

    `target`: weightsvc's gRPC `host:port`; `engine`: the base URL of the `vllm serve` that follows
    `model` (started with `--enable-scale-out`, and `--logprobs-mode processed_logprobs` so that its
    log-probabilities are those of the temperature it samples at). `format` / `rounding` override the
    service's export for this model's pushes (empty: the service's). `on_policy`: each rollout batch
    waits until the engine serves the version of the current step (otherwise it takes what the engine
    serves, and the token versions show how far behind that was). `ablate_every` (0: never): every
    that many steps, the rollout batch's mismatch is also measured with the learner's log-probabilities
    on the fp32 masters and on a round-to-nearest copy of them (`ablation`, kept here, never reported):
    two more no-grad forwards of the batch.

    `publish` (a service started with `serve --nixl`): each sync publishes the served copy the learner
    computes (`served_state_dict` of the masters, version = step; `LearnerClient.publish`) instead of
    pushing the fp32 masters, and the loss runs on those very tensors. The copy must be exported with
    the service's own spec (a publish cannot override it): `spec`, or else that of the model's latest
    version on the service; `format` / `rounding` (a push's overrides) are refused. With `ef` the
    residual is the learner's (`residual`, fresh at the first publish). The learner measures each
    published version's lag on its masters and the copy it exported (`publish(masters=, lag=)`), the
    service records it as a push's, and `lag` holds it as for a push."""

    target: str
    engine: str
    model: str = "default"
    format: str = ""
    rounding: str = ""
    on_policy: bool = True
    timeout_s: float = 120.0
    ablate_every: int = 0
    lag: dict[int, LagMetrics] = field(default_factory=dict)
    mismatch: list[tuple[int, dict[int, RolloutMismatch]]] = field(default_factory=list)
    ablation: list[tuple[int, dict[str, RolloutMismatch]]] = field(default_factory=list)
    spec: ExportSpec | None = None  # the export to recompute the served copy by (None: the version's manifest)
    publish: bool = False
    served_from: str = ""  # "local" (recomputed), "pulled" (found out over the first versions), or "published"
    residual: Residual | None = field(default=None, repr=False)  # the learner's, when it publishes under `ef`
    rank_lag: RankLag = field(default_factory=RankLag, repr=False)  # the learner's lag state, when it publishes
    served: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    version: int | None = None
    versions: list[list[int]] = field(default_factory=list, repr=False)  # of the last rollout batch's tokens
    _learner: LearnerClient | None = field(default=None, repr=False)
    _checked: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.publish and (self.format or self.rounding):
            given = ", ".join(f"{k}={v!r}" for k, v in (("format", self.format), ("rounding", self.rounding)) if v)
            raise ValueError(f"model {self.model!r}: publish commits the copy only in the service's own export, which "
                             f"{given} would override (a push's overrides): pass spec=ExportSpec(...) as the "
                             "service runs (serve --format, --rounding, --seed) instead")

    # -- the masters: one version per optimizer step -------------------------------------------------

    def push(self, module: torch.nn.Module | Mapping[str, torch.Tensor], step: int) -> None:
        """Push the masters (`module`'s state dict, or the tensors given) as version `step`, keep the
        service's lag of it, and hold its served copy, which the learner's forwards run on until the
        next step: recomputed here (`served_state_dict`) while the first versions show the learner's
        bits are the service's, else pulled back (`ef`, whose residual is the service's state, or a
        spec the learner cannot rebuild from the manifest). With `publish`, the served copy is exported
        here and published instead (`_publish`). On one process the whole state dict; ranks holding the
        same masters push identical versions."""
        if self._learner is None:
            self._learner = LearnerClient(self.target, timeout=self.timeout_s)
        state = module.state_dict() if isinstance(module, torch.nn.Module) else module
        masters = {n: t.detach() for n, t in state.items()}
        sharded = [n for n, t in masters.items() if isinstance(t, DTensor)]
        if sharded:  # (each rank would push its own rows as `Shard`s, and the served copy be made per shard)
            raise NotImplementedError(f"{subject(self.model, step)}: masters {sharded[:3]} are sharded "
                                      "(FSDP DTensors); this trainer pushes whole state dicts")
        if self.publish:
            self._publish(masters, step)
            self.version = step
            return
        info = self._learner.push(step, masters, self.model, format=self.format, rounding=self.rounding,
                                  return_served=self.served_from == "pulled")
        if info.lag is not None:
            self.lag[step] = info.lag
        if self.served_from == "pulled":
            assert info.served is not None
            self.served = info.served
        else:
            self.served = served_state_dict(module if isinstance(module, torch.nn.Module) else masters,
                                            self._spec(step), version=step)
            if self._checked < CHECKED_VERSIONS:  # the first versions: the local bits against the manifest
                self._checked += 1
                self.served_from = self._check(step)
                if self.served_from == "pulled":
                    with InferenceClient(self.target, timeout=self.timeout_s) as client:
                        self.served = client.pull(self.model, step)
        self.version = step

    def _publish(self, masters: dict[str, torch.Tensor], step: int) -> None:
        """Publish the served copy of `masters` as version `step`, and hold those very tensors as the
        copy the learner's forwards run on: the service checked their bytes against their checksums,
        so what it commits is what the loss sees."""
        assert self._learner is not None
        spec, said = self._publish_spec(step)
        residual = None
        if spec.rounding == "ef":  # (the service keeps no residual of a published copy: the learner's is it)
            # Advanced on a copy, kept once the version commits: a publish that fails can be made again.
            # (The export replaces each tensor's residual array, so a copy of the dict is enough.)
            residual = self.residual or Residual()
            residual = dataclasses.replace(residual, tensors=dict(residual.tensors))
        served = served_state_dict(masters, spec, version=step, residual=residual)
        try:
            info = self._learner.publish(step, _in_host_memory(served), self.model, spec=spec,
                                         master_digest=masters_digest_of(masters), masters=masters, lag=self.rank_lag)
        except WeightsvcError as e:
            raise _named(e, f"{subject(self.model, step)}: the service did not commit the served copy the "
                            f"learner published ({spec.format} {spec.rounding} seed {spec.seed}, {said})") from None
        self.served, self.served_from, self.residual = served, "published", residual or self.residual
        if info.lag is not None:
            self.lag[step] = info.lag

    def _publish_spec(self, version: int) -> tuple[ExportSpec, str]:
        """The service's export spec, and where it came from: `spec`, or the model's latest version."""
        if self.spec is not None:
            return self.spec, "as given (spec=)"
        with InferenceClient(self.target, timeout=self.timeout_s) as client:
            try:
                m = client.manifest(self.model, "latest")
            except NotFound:
                raise ValueError(f"{subject(self.model, version)}: publishing needs the service's export spec, and the "
                                 "service holds no version of the model to read it from: pass spec=ExportSpec(...) "
                                 "as the service runs (serve --format, --rounding, --seed)") from None
        self.spec = ExportSpec(m.format, m.rounding, seed=m.seed, **({"scaling": m.scaling} if m.scaling else {}))
        return self.spec, f"read from version {m.version}'s manifest"

    def _spec(self, version: int) -> ExportSpec:
        if self.spec is None:
            with InferenceClient(self.target, timeout=self.timeout_s) as client:
                m = client.manifest(self.model, version)
            self.spec = ExportSpec(m.format, m.rounding, seed=m.seed, **({"scaling": m.scaling} if m.scaling else {}))
        return self.spec

    def _check(self, version: int) -> str:
        assert self.spec is not None
        if self.spec.rounding == "ef":
            return "pulled"
        try:
            with InferenceClient(self.target, timeout=self.timeout_s) as client:
                check_served(client, self.model, version, spec=self.spec, served=self.served)
        except ServedMismatch:
            return "pulled"
        return "local"

    def close(self) -> None:
        if self._learner is not None:
            self._learner.close()
            self._learner = None

    @contextmanager
    def on_served_copy(self, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The forward on the served copy of the last pushed version, gradients to the masters."""
        if self.version is None:
            raise RuntimeError(f"model {self.model!r}: no version pushed yet, so no served copy to run on")
        with served_weights(module, self.served):
            yield module

    # -- the engine ----------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """TRL's sync point before a rollout batch: weightsvc and the follower move the weights; on
        policy, this waits until the engine serves the version last pushed."""
        if not self.on_policy or self.version is None:
            return
        want, deadline = str(self.version), time.monotonic() + self.timeout_s
        api = EngineApi(self.engine, self.timeout_s)
        while (label := api.weight_version("rollout")) != want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine} serves weight_version {label!r}, not version {want} of "
                                   f"model {self.model!r}, after {self.timeout_s} s: is `weightsvc follow` running?")
            time.sleep(0.02)  # (the engine's label is state, not an event: nothing to wait on)

    def rollout(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, Any]:
        """TRL's `rollout_func`: one completion per prompt from the engine's token-in/token-out route,
        with the log-probability and weight version of each token."""
        tokenizer: Any = trainer.processing_class
        prompt_ids = tokenizer(text=prompts)["input_ids"]
        params = {"temperature": trainer.temperature, "top_p": trainer.top_p,
                  "max_tokens": trainer.max_completion_length, "logprobs": 0,
                  **(getattr(trainer.args, "generation_kwargs", None) or {})}

        api = EngineApi(self.engine, self.timeout_s)

        def one(ids: list[int]) -> dict[str, Any]:
            out = api.post("/inference/v1/generate", {"token_ids": ids, "sampling_params": params}, stage="rollout")
            return dict(out["choices"][0])

        with ThreadPoolExecutor(max(1, len(prompt_ids))) as pool:  # the engine batches them
            choices = list(pool.map(one, prompt_ids))
        completion_ids = [list(c["token_ids"]) for c in choices]
        logprobs = [[t["logprob"] for t in c["logprobs"]["content"]] for c in choices]
        self.versions = [token_versions(c.get("weight_versions"), len(ids))
                         for c, ids in zip(choices, completion_ids, strict=True)]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    def report_mismatch(self, step: int, learner: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> None:
        """The mismatch of one rollout batch (learner's and engine's log-probabilities of its tokens, as
        TRL padded them) by weight version: kept, and reported to the service. Tokens without a version
        or that the engine could not score (NaN) are left out."""
        versions, keep = self._kept(engine, mask)
        self.report(step, rollout_mismatch(learner.detach().cpu(), engine.detach().cpu(), versions, mask=keep))

    def report(self, step: int, by_version: dict[int, RolloutMismatch]) -> None:
        """Keep the mismatch the learner measured at `step`, by weight version, and report it to the service."""
        if not by_version:
            return
        self.mismatch.append((step, by_version))
        assert self._learner is not None  # (a version was pushed before any rollout)
        self._learner.report_mismatch(self.model, by_version, step=step)

    def ablation_due(self, step: int) -> bool:
        return self.ablate_every > 0 and step % self.ablate_every == 0

    def ablate(self, step: int, learner: dict[str, torch.Tensor], engine: torch.Tensor, mask: torch.Tensor) -> None:
        """Keep the mismatch of one rollout batch's tokens of the last pushed version for each of the
        learner's copies (`learner`: name -> log-probabilities); a diagnostic, so nothing is reported."""
        versions, keep = self._kept(engine, mask)
        keep &= versions == self.version
        if not bool(keep.any()):
            return
        engine = engine.detach().cpu()
        self.ablation.append((step, {name: rollout_mismatch(logps.detach().cpu(), engine, versions, mask=keep)[
            int(self.version or 0)] for name, logps in learner.items()}))

    def _kept(self, engine: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight version of each padded token, and which tokens count: in the completion, with a
        version, scored by the engine (not NaN)."""
        versions = torch.full(mask.shape, UNKNOWN_VERSION, dtype=torch.long)
        for row, v in enumerate(self.versions):
            width = min(len(v), mask.shape[1])
            versions[row, :width] = torch.tensor(v[:width], dtype=torch.long)
        return versions, mask.cpu().bool() & (versions >= 0) & torch.isfinite(engine.detach().cpu())


def _in_host_memory(served: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The served tensors where NIXL reads them (contiguous, in host memory): those already there as they
    are, others copied; a tied tensor, one object under several names, stays one copy."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in served.items():
        if t.device.type == "cpu" and t.is_contiguous():
            out[name] = t
        else:
            out[name] = copies.setdefault(id(t), t.detach().to("cpu").contiguous())
    return out


def _named(e: WeightsvcError, what: str) -> WeightsvcError:
    """`e` (its type and reason kept), its message led by what it is about."""
    e.message = f"{what}: {e.message}"
    e.args = (e.message,)
    return e


class _PushMasters(TrainerCallback):  # type: ignore[misc]
    """Version 0 before the first step (the masters the engine starts from), then one per optimizer step."""

    def __init__(self, sync: WeightsvcSync) -> None:
        self.sync = sync

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       **kwargs: Any) -> None:
        assert model is not None
        self.sync.push(model, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                    **kwargs: Any) -> None:
        assert model is not None
        self.sync.push(model, state.global_step)


class FairCastGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
    """`GRPOTrainer` whose rollouts come from a `vllm serve` following weightsvc and whose loss is
    computed on the served copy; every argument but `sync` (and `rollout_func`, which it sets) is TRL's."""

    def __init__(self, *args: Any, sync: WeightsvcSync, **kwargs: Any) -> None:
        if kwargs.get("rollout_func") is not None:
            raise ValueError("FairCastGRPOTrainer sets rollout_func itself (the engine following weightsvc)")
        training_args = kwargs.get("args")
        if training_args is not None and training_args.use_vllm:
            raise ValueError("use_vllm must be False: the engine is reached over HTTP and weightsvc moves the weights")
        self.sync = sync
        kwargs["rollout_func"] = sync.rollout
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), _PushMasters(sync)]
        super().__init__(*args, **kwargs)
        # TRL's importance-sampling correction and its sync point, with weightsvc as the transport.
        self.use_vllm = True
        self.vllm_generation = sync  # type: ignore[assignment]
        self._last_loaded_step = -1
        self._ablation_batch: dict[str, Any] | None = None

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        # Generation, the old log-probabilities and the loss all see the served copy.
        module = self.accelerator.unwrap_model(model)
        with self.sync.on_served_copy(module):
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        if self._ablation_batch is not None:  # (the masters are still the version the batch was rolled out on)
            batch, self._ablation_batch = self._ablation_batch, None
            self._ablate(module, batch)
        return loss

    def _ablate(self, module: torch.nn.Module, batch: dict[str, Any]) -> None:
        """The batch's log-probabilities on the fp32 masters and on a round-to-nearest copy of them in
        the served format, against those on the served copy that the loss used."""
        sync = self.sync
        assert sync.spec is not None and sync.version is not None
        learner = {"served": batch["old_per_token_logps"], "masters": self._logps(batch)}
        rtn = served_state_dict(module, dataclasses.replace(sync.spec, rounding="rtn"), version=sync.version)
        with served_weights(module, rtn):
            learner["rtn copy"] = self._logps(batch)
        sync.ablate(self.state.global_step, learner, batch["sampling_per_token_logps"], batch["completion_mask"])

    def _logps(self, batch: dict[str, Any]) -> torch.Tensor:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, batch["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size)
        return logps

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        if self.model is not None and self.model.training and "sampling_per_token_logps" in output:
            self.sync.report_mismatch(self.state.global_step, output["old_per_token_logps"],
                                      output["sampling_per_token_logps"], output["completion_mask"])
            if self.sync.ablation_due(self.state.global_step):
                self._ablation_batch = output
        return output

