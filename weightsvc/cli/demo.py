"""`weightsvc demo`: the paper's experiment, end to end through a real service.

For each rounding mode, a small policy is fine-tuned with REINFORCE and Adam (lr 1e-5) from a
checkpoint on the served format's grid. Every step the learner pushes its fp32 masters, an inference
client pulls the served copy, the rollouts are sampled from the served copy and the learner's loss
is computed on it (Fair Cast); the gradients update the fp32 masters.

The task is a contextual bandit: 8 contexts, each a ±1 feature vector of length 1024 (the hidden
state of a frozen trunk), 8 actions, reward 1 for the context's best action (chance: 1/8). The
policy's logits are the difference of two heads, `pos(h) - neg(h)`, both (8, 1024) `*.weight`
matrices loaded from the same checkpoint matrix: the policy starts indifferent (logits exactly 0)
while every weight has a magnitude in [0.5, 1). An Adam step of ~1e-5 is then ~1/200 of half a bf16
ulp (2**-9 in that binade): round to nearest serves the checkpoint unchanged for about 200 steps,
until the masters have moved half an ulp, whereas the unbiased modes serve the masters' movement
from the first step; a margin of a few logits is the sum of 2 x 1024 such sub-ulp moves.

Measured (`weightsvc demo --json`, 300 steps, figures in docs/lag.md): in bf16 the unbiased modes
reach a mean reward of 0.5 over 20 steps at steps 116-120 (reward AUC ~0.6), rtn at step 214 (AUC
0.395), after which it jumps past them: its masters kept moving the same way while its served copy
stood still. In fp8_e4m3 (half an ulp is ~1/30 of a weight) rtn serves the checkpoint for the whole
run and stays at chance (AUC 0.128), sr and sr-sticky learn as in bf16, ef learns later.
The masters start on the served format's grid (as a bf16 or fp8 checkpoint would): off the grid,
round to nearest acts like a sticky stochastic rounding, since where each element sits in its
cell is random, and would hide nothing.
The service measures the lag of each committed version (weightsvc.protocol.lag).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsvc import rounding
from weightsvc.client import InferenceClient, LearnerClient, dequantized, served_weights
from weightsvc.server.server import BackgroundServer
from weightsvc.settings import Settings

MODES = ("rtn", "sr", "sr-sticky", "ef")
REWARD_THRESHOLD = 0.5  # steps_to_reward: the smoothed reward reaches this (chance is 1 / actions)
REWARD_WINDOW = 20  # steps of the smoothed reward's trailing mean


def smoothed(reward: list[float], window: int = REWARD_WINDOW) -> list[float]:
    """The trailing mean of the last `window` steps' rewards (fewer at the start)."""
    return [sum(reward[max(0, i + 1 - window) : i + 1]) / min(i + 1, window) for i in range(len(reward))]


@dataclass
class Trace:
    mode: str
    lag: list[int] = field(default_factory=list)
    visibility: list[float | None] = field(default_factory=list)
    churn: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        changed = [i for i, c in enumerate(self.churn) if c > 0]
        seen = [v for v in self.visibility if v is not None]
        tail = self.reward[-max(1, len(self.reward) // 10) :]
        reached = [i for i, r in enumerate(smoothed(self.reward)) if r >= REWARD_THRESHOLD]
        return {
            "first_change_step": changed[0] + 1 if changed else None,
            "lag_max": max(self.lag),
            "lag_mean": round(sum(self.lag) / len(self.lag), 2),
            "visibility_mean": round(sum(seen) / len(seen), 3) + 0.0 if seen else None,  # + 0.0: no -0.0
            "churn_mean": round(sum(self.churn) / len(self.churn), 4),
            "final_reward": round(sum(tail) / len(tail), 3),
            "steps_to_reward": reached[0] + 1 if reached else None,
            "reward_threshold": REWARD_THRESHOLD,
            "reward_auc": round(sum(self.reward) / len(self.reward), 3),
        }


class Policy(torch.nn.Module):
    """Features -> action logits `pos(h) - neg(h)`: two 2-D `*.weight` heads, so every tensor is one
    that scaled formats (fp8, MX, NVFP4) apply to; rows of 1024 fill whole 16- and 32-element blocks."""

    def __init__(self, features: int, actions: int) -> None:
        super().__init__()
        self.pos = torch.nn.Linear(features, actions, bias=False)
        self.neg = torch.nn.Linear(features, actions, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.pos(h) - self.neg(h)


def load_checkpoint(policy: Policy, spec: rounding.ExportSpec, gen: torch.Generator) -> None:
    """Both heads get one matrix of weights of magnitude in [0.5, 1) and random sign, snapped to the
    served format's grid (its round-to-nearest export, dequantized): the logits start at exactly 0
    and every mode serves the checkpoint unchanged until the masters move."""
    shape = policy.pos.weight.shape
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    matrix = (0.5 + 0.5 * torch.rand(shape, generator=gen)) * sign
    on_grid = rounding.ExportSpec(spec.format, "rtn", spec.seed, spec.scaling, spec.fp8_pattern)
    start = dequantized(rounding.export_state_dict({"pos.weight": matrix}, on_grid, version=0, device="cpu"),
                        "pos.weight")
    with torch.no_grad():
        policy.pos.weight.copy_(start)
        policy.neg.weight.copy_(start)


def run_mode(target: str, mode: str, spec: rounding.ExportSpec, *, steps: int, lr: float, batch: int,
             seed: int = 0, contexts: int = 8, actions: int = 8, features: int = 1024) -> Trace:
    gen = torch.Generator().manual_seed(seed)  # the same task, start and rollout draws in every mode
    hidden = (torch.randint(0, 2, (contexts, features), generator=gen) * 2 - 1).float()
    best = torch.randint(0, actions, (contexts,), generator=gen)
    policy = Policy(features, actions)
    load_checkpoint(policy, spec, gen)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    learner, puller = LearnerClient(target), InferenceClient(target)
    model, trace = f"demo-{mode}", Trace(mode)
    for step in range(1, steps + 1):
        masters = {name: p.detach() for name, p in policy.named_parameters()}
        info = learner.push(step, masters, model=model, rounding=mode)
        assert info.lag is not None
        trace.lag.append(info.lag.lag_steps)
        trace.visibility.append(info.lag.update_visibility)
        trace.churn.append(info.lag.churn)
        served = puller.pull(model, step)
        ctx = torch.randint(0, contexts, (batch,), generator=gen)
        with served_weights(policy, served):  # rollouts and loss on the served copy, gradients on the masters
            logp = torch.log_softmax(policy(hidden[ctx]), dim=-1)
            action = torch.multinomial(logp.exp().detach(), 1, generator=gen).squeeze(1)
            reward = (action == best[ctx]).float()
            loss = -((reward - reward.mean()) * logp.gather(1, action[:, None]).squeeze(1)).mean()
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        trace.reward.append(reward.mean().item())
    learner.close()
    puller.close()
    return trace


def run_demo(
    *,
    steps: int = 300,
    lr: float = 1e-5,
    batch: int = 256,
    format: str = "bf16",
    png: Path | None = None,
    log: Callable[[str], Any] | None = None,
) -> dict[str, dict[str, Any]]:
    say = log or (lambda _m: None)
    settings = Settings(grpc_port=0, http_port=0, probe_port=0, retain=4, format=format)
    spec = rounding.ExportSpec(settings.format, "rtn", settings.seed, settings.scaling, settings.fp8_pattern)
    traces = {}
    with BackgroundServer(settings) as srv:
        for mode in MODES:
            say(f"mode {mode}: {steps} steps, {format}, Adam lr {lr:g}")
            traces[mode] = run_mode(srv.grpc_target, mode, spec, steps=steps, lr=lr, batch=batch)
    if png is not None:
        plot(traces, png, format)
        say(f"plot written to {png}")
    return {mode: t.summary() for mode, t in traces.items()}


def plot(traces: dict[str, Trace], path: Path, format: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lag, ax_reward) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, t in traces.items():
        x = range(1, len(t.lag) + 1)
        ax_lag.plot(x, t.lag, label=mode)
        ax_reward.plot(x, smoothed(t.reward), label=mode)
    ax_reward.axhline(REWARD_THRESHOLD, color="grey", linestyle=":", linewidth=1)
    ax_lag.set(title=f"served policy lag behind the learner ({format})", xlabel="step", ylabel="lag (steps)")
    ax_reward.set(title=f"reward of the served policy ({format})", xlabel="step",
                  ylabel=f"mean reward, last {REWARD_WINDOW} steps")
    for ax in (ax_lag, ax_reward):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COLUMNS = {  # summary key -> table header
    "first_change_step": "first change (step)",
    "lag_max": "lag max",
    "lag_mean": "lag mean",
    "visibility_mean": "visibility mean",
    "churn_mean": "churn mean",
    "steps_to_reward": f"steps to reward {REWARD_THRESHOLD:g}",
    "reward_auc": "reward AUC",
    "final_reward": "final reward",
}


def as_rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    def fmt(v: Any) -> str:
        return "-" if v is None else (f"{v:g}" if isinstance(v, float) and not math.isnan(v) else str(v))

    return [[mode, *(fmt(r[k]) for k in COLUMNS)] for mode, r in results.items()]


__all__ = ["COLUMNS", "MODES", "REWARD_THRESHOLD", "REWARD_WINDOW", "Trace", "as_rows", "asdict", "run_demo"]
