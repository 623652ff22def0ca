"""What the learner pays to compute its loss on the served copy (`on_served_copy`), against the same
forward (and forward + backward) on its fp32 masters under plain bf16 autocast, in the same run.

    PYTHONPATH=. python scripts/served_copy_cost.py [--dim 256 --layers 4 --vocab 4096 --tokens 256 --repeats 9]

A small transformer-shaped module (tied embeddings and head, per layer an attention-shaped and an
MLP-shaped pair of linears, norms). Timings alternate between the ways and take the median; they
are CPU seconds of the process (one torch thread by default), which a busy machine disturbs less
than wall time. `served` holds the copy in fp32 (the default: `dtype=None`), `served_bf16` in bf16
(`dtype=torch.bfloat16`). `enter` is the cost once per version: the served copy computed from the
masters (Fair Cast, on the CPU) and put in place. Prints one JSON object; ratios are served / plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from weightsvc.integrations.fair_cast import on_served_copy
from weightsvc.rounding import ExportSpec


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).chunk(3, -1)
        h = h + self.proj(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm2(h))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def seconds(fn: Callable[[], object]) -> float:
    """CPU seconds of this process: on a shared, busy machine the work, not the wait for a core."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=256, help="per forward (batches of 128)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rounding", default="sr")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Model(args.vocab, args.dim, args.layers)
    tokens = torch.randint(0, args.vocab, (max(1, args.tokens // 128), min(128, args.tokens)))
    spec = ExportSpec("bf16", args.rounding)
    _enter(model, spec, 0)  # (the kernels' first call compiles them; their threading layer sets torch's threads)
    torch.set_num_threads(args.threads)

    def forward() -> None:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            model(tokens)

    def step() -> None:
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    ways: dict[str, Callable[[Callable[[], None]], float]] = {
        "plain": lambda fn: seconds(fn),
        "served": lambda fn: _on(model, spec, fn, None),
        "served_bf16": lambda fn: _on(model, spec, fn, torch.bfloat16),
    }
    times: dict[str, dict[str, list[float]]] = {w: {"forward": [], "forward_backward": []} for w in ways}
    enter: list[float] = []
    for what, fn in (("forward", forward), ("forward_backward", step)):
        for way in ways:  # (warm-up: the first call of each way)
            ways[way](fn)
        for r in range(args.repeats):
            for way in ways:
                times[way][what].append(ways[way](fn))
            if what == "forward":
                enter.append(seconds(lambda v=r: _enter(model, spec, v)))
    med = {w: {k: statistics.median(v) for k, v in d.items()} for w, d in times.items()}
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "tokens": tokens.numel(),
        "threads": torch.get_num_threads(),
        "seconds": med,
        "enter_seconds": statistics.median(enter),
        "ratio_forward": med["served"]["forward"] / med["plain"]["forward"],
        "ratio_forward_backward": med["served"]["forward_backward"] / med["plain"]["forward_backward"],
        "ratio_forward_bf16_copy": med["served_bf16"]["forward"] / med["plain"]["forward"],
        "ratio_forward_backward_bf16_copy": med["served_bf16"]["forward_backward"] / med["plain"]["forward_backward"],
        # A training step: one version entered, one forward + backward on it.
        "ratio_step_with_enter": (statistics.median(enter) + med["served"]["forward_backward"])
        / med["plain"]["forward_backward"],
    }
    print(json.dumps(out, indent=1))


def _on(model: nn.Module, spec: ExportSpec, fn: Callable[[], None], dtype: torch.dtype | None) -> float:
    """The time of `fn` on the served copy (entered outside the timing: `enter` counts that)."""
    with on_served_copy(model, spec, version=1, dtype=dtype):
        return seconds(fn)


def _enter(model: nn.Module, spec: ExportSpec, version: int) -> None:
    with on_served_copy(model, spec, version=version):
        pass


if __name__ == "__main__":
    main()
