"""What the figures share: the model they move, the server they start, best-of timing, report rows."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from weightsvc.cli._server import ServeProcess

if TYPE_CHECKING:
    import torch

TENSOR_MIB = 16  # a typical transformer matrix (2048 x 2048 fp32)
PULLERS = 8


def make_model(size_mib: int) -> dict[str, torch.Tensor]:
    """fp32 masters of `size_mib` in matrices of TENSOR_MIB (2048 wide), the same every run."""
    import torch  # (the peers and the sass process import this module, and need no torch)

    gen = torch.Generator().manual_seed(0)
    tensor_mib = max(1, min(TENSOR_MIB, size_mib))
    n = max(1, size_mib // tensor_mib)
    side = max(1, ((tensor_mib << 20) // 4) // 2048)
    return {f"layers.{i}.weight": torch.randn(side, 2048, generator=gen) * 0.02 for i in range(n)}


def serve(retain: int, *args: str) -> ServeProcess:
    """A server process with `--retain`, logging warnings only, to this process's stderr."""
    return ServeProcess("--retain", str(retain), "--log-level", "warning", *args, capture_stderr=False)


def best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of `repeat` calls of `fn`, in seconds."""

    def once() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return best(once, repeat)


def row(what: str, value: str, target: str = "") -> dict[str, str]:
    """One row of the report: what the figure is, its value, what it should be."""
    return {"what": what, "value": value, "target": target}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
