"""A learner rank of the publish tests, a process of its own: it exports the served copy of version STEP
of the test's masters (`served_state_dict`) and publishes its share of every tensor's flat elements
(rank r of w holds [r n / w, (r + 1) n / w)) with `LearnerClient(TARGET).publish`.

    python -m tests.integration.publish_rank TARGET MODEL STEP RANK WORLD_SIZE [--shape NAME=D,D]
        [--steps N] [--lag]

--shape declares tensor NAME with another shape (its bytes as they are): a rank that disagrees with
the others. --steps publishes versions STEP .. STEP + N - 1 of a run (`moved`), one after the other;
--lag sends each one's lag sums of the rank's rows (`publish(masters=, lag=)`). It prints `ready` once
its copies and its NIXL agent are made, publishes once it reads a line (the test starts every rank,
then lets them go together: they meet within the server's rank timeout however slowly each process
started), then prints its last line: `ok VERSION CREATED` (of the last version) or
`error CODE MESSAGE`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from weightsvc import LearnerClient
from weightsvc.client import RankLag, Shard
from weightsvc.client._nixl_publish import _agent
from weightsvc.errors import WeightsvcError
from weightsvc.integrations.fair_cast import served_state_dict
from weightsvc.rounding import ExportSpec

SPEC = ExportSpec("bf16", "sr", seed=0)  # `serve`'s defaults


def masters(seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 masters of a small transformer's shapes, odd sizes included."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (97, 64), "layers.0.attn.qkv.weight": (192, 64), "layers.0.mlp.up.weight": (300, 64),
              "layers.0.norm.weight": (64,), "lm_head.bias": (97,), "scalar": ()}
    return {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}


def moved(step: int) -> dict[str, torch.Tensor]:
    """The masters of version `step` of a run: `masters()` drifting by about an ulp of bf16 a step."""
    start, drift = masters(0), masters(1)
    return {name: start[name] + step * 0.005 * drift[name] for name in start}


def share(served: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, Shard]:
    """Rank `rank`'s share of each served tensor: a contiguous run of its flat elements."""
    out = {}
    for name, t in served.items():
        flat = t.reshape(-1)
        start, end = rank * flat.numel() // world_size, (rank + 1) * flat.numel() // world_size
        out[name] = Shard(flat[start:end], start, tuple(t.shape))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("model")
    parser.add_argument("step", type=int)
    parser.add_argument("rank", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("--shape", default=None)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--lag", action="store_true")
    args = parser.parse_args()
    runs = {}  # version -> (this rank's served copy, its masters)
    for step in range(args.step, args.step + args.steps) if args.steps else (args.step,):
        m = moved(step) if args.steps else masters()
        runs[step] = (share(served_state_dict(m, SPEC, version=step), args.rank, args.world_size),
                      share(m, args.rank, args.world_size))
    if args.shape:
        mine = runs[args.step][0]
        name, _, dims = args.shape.partition("=")
        mine[name] = Shard(mine[name].data, mine[name].offset, tuple(int(d) for d in dims.split(",")))
    lag = RankLag() if args.lag else None
    _agent()  # (made now, not inside the publish: it takes a while)
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        with LearnerClient(args.target) as learner:
            for step, (mine, rows) in runs.items():
                info = learner.publish(step, mine, args.model, rank=args.rank, world_size=args.world_size, spec=SPEC,
                                       masters=rows if lag else None, lag=lag)
    except WeightsvcError as e:
        print("error", type(e).__name__, e.message, flush=True)
        sys.exit(0)
    print("ok", info.version, info.created, flush=True)


if __name__ == "__main__":
    main()
