"""`weightsvc demo`: the paper's experiment, end to end through a real service.

For each rounding mode, a small policy is fine-tuned with REINFORCE and Adam from a bf16-exact
start. Every step the learner pushes its fp32 masters, pulls the served copy back, samples its
rollouts from the served copy and computes its loss on it (gradients are applied to the masters).
The service measures the lag of each committed version (weightsvc.core.lag); round to nearest hides
small Adam steps and lags by tens of steps, the unbiased modes do not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsvc.client import InferenceClient, LearnerClient
from weightsvc.server.server import BackgroundServer
from weightsvc.settings import Settings

MODES = ("rtn", "sr", "sr-sticky", "ef")


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
        return {
            "first_change_step": changed[0] + 1 if changed else None,
            "lag_max": max(self.lag),
            "lag_mean": round(sum(self.lag) / len(self.lag), 2),
            "visibility_mean": round(sum(seen) / len(seen), 3) if seen else None,
            "churn_mean": round(sum(self.churn) / len(self.churn), 4),
            "final_reward": round(sum(tail) / len(tail), 3),
        }


class Policy(torch.nn.Module):
    """Context -> action logits: a two-layer MLP, built in code (no download)."""

    def __init__(self, contexts: int, actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.body = torch.nn.Linear(contexts, hidden)
        self.head = torch.nn.Linear(hidden, actions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def run_mode(target: str, mode: str, *, steps: int, lr: float, batch: int, seed: int = 0,
             contexts: int = 32, actions: int = 16) -> Trace:  # fmt: skip
    torch.manual_seed(seed)
    policy = Policy(contexts, actions)
    with torch.no_grad():  # a bf16-exact start, as when fine-tuning a bf16 checkpoint
        for p in policy.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    served = Policy(contexts, actions)
    masters = dict(policy.named_parameters())
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    best = torch.randint(0, actions, (contexts,), generator=torch.Generator().manual_seed(seed + 1))
    gen = torch.Generator().manual_seed(seed + 2)
    learner, puller = LearnerClient(target), InferenceClient(target)
    model, trace = f"demo-{mode}", Trace(mode)
    for step in range(1, steps + 1):
        info = learner.push(step, {k: v.detach() for k, v in masters.items()}, model=model, rounding=mode)
        assert info.lag is not None
        trace.lag.append(info.lag.lag_steps)
        trace.visibility.append(info.lag.update_visibility)
        trace.churn.append(info.lag.churn)
        weights = puller.pull(model, step)
        with torch.no_grad():  # the served copy is what the rollouts and the loss see
            for name, p in served.named_parameters():
                p.copy_(weights[name].float())
        ctx = torch.randint(0, contexts, (batch,), generator=gen)
        x = torch.nn.functional.one_hot(ctx, contexts).float()
        logp = torch.log_softmax(served(x), dim=-1)
        action = torch.multinomial(logp.exp().detach(), 1, generator=gen).squeeze(1)
        reward = (action == best[ctx]).float()
        loss = -((reward - reward.mean()) * logp.gather(1, action[:, None]).squeeze(1)).mean()
        served.zero_grad()
        loss.backward()
        for (_, master), (_, p) in zip(policy.named_parameters(), served.named_parameters(), strict=True):
            assert p.grad is not None
            master.grad = p.grad.clone()  # gradients at the served weights update the fp32 masters
        optimizer.step()
        trace.reward.append(reward.mean().item())
    learner.close()
    puller.close()
    return trace


def run_demo(*, steps: int = 300, lr: float = 3e-6, batch: int = 256, png: Path | None = None,
             log: Callable[[str], Any] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    say = log or (lambda _m: None)
    traces = {}
    with BackgroundServer(Settings(grpc_port=0, http_port=0, retain=4)) as srv:
        for mode in MODES:
            say(f"mode {mode}: {steps} steps, Adam lr {lr:g}")
            traces[mode] = run_mode(srv.grpc_target, mode, steps=steps, lr=lr, batch=batch)
    if png is not None:
        plot(traces, png)
        say(f"plot written to {png}")
    return {mode: t.summary() for mode, t in traces.items()}


def plot(traces: dict[str, Trace], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lag, ax_reward) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, t in traces.items():
        x = range(1, len(t.lag) + 1)
        ax_lag.plot(x, t.lag, label=mode)
        window = max(1, len(t.reward) // 20)
        smooth = [
            sum(t.reward[max(0, i - window) : i + 1]) / (i + 1 - max(0, i - window)) for i in range(len(t.reward))
        ]
        ax_reward.plot(x, smooth, label=mode)
    ax_lag.set(title="served policy lag behind the learner", xlabel="step", ylabel="lag (steps)")
    ax_reward.set(title="reward (served policy)", xlabel="step", ylabel=f"mean reward, {window}-step window")
    for ax in (ax_lag, ax_reward):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def as_rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    def fmt(v: Any) -> str:
        return "-" if v is None else (f"{v:g}" if isinstance(v, float) and not math.isnan(v) else str(v))

    keys = ("first_change_step", "lag_max", "lag_mean", "visibility_mean", "churn_mean", "final_reward")
    return [[mode, *(fmt(r[k]) for k in keys)] for mode, r in results.items()]


__all__ = ["MODES", "Trace", "as_rows", "asdict", "run_demo"]
