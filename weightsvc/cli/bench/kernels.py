"""K1/K2: the CPU export kernels against a plain cast on the same tensor."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from weightsvc.cli.bench._common import best_seconds, row


def _torch_ops_sr(x: torch.Tensor) -> torch.Tensor:
    """SR to bf16 composed from torch ops, as torchao's bf16 optimizer does it (the baseline)."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32)
    bits = (x.view(torch.int32) + noise) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


def kernel_bench(*, size_mib: int = 256, repeat: int = 5) -> dict[str, float]:
    """K1/K2: fused export vs `x.to(torch.bfloat16)` on the same tensor, all cores, out of cache."""
    from weightsvc import rounding

    rounding.use_threads(os.cpu_count() or 1)
    x = torch.randn((size_mib << 20) // 4) * 0.02
    flat = x.numpy()
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    out_bytes = out.view(torch.uint8).numpy()
    residual = rounding.Residual()
    res_in = residual.tensor("w", x.numel())
    res_out = np.empty_like(res_in)

    def timed(fn: Callable[[], object]) -> float:
        fn()  # warm-up: compile, fault in
        return best_seconds(fn, repeat)

    cast_s = timed(lambda: x.to(torch.bfloat16))
    spec_sr, spec_ef = rounding.ExportSpec("bf16", "sr"), rounding.ExportSpec("bf16", "ef")
    sr_s = timed(lambda: rounding.export_array(flat, out_bytes, spec_sr, version=1, name="w"))
    ef_s = timed(lambda: rounding.export_array(flat, out_bytes, spec_ef, version=1, name="w", residual=res_in,
                                               new_residual=res_out))
    torch_sr_s = timed(lambda: _torch_ops_sr(x))
    # The scaled formats' kernel (the generic one: fp8, mxfp8, nvfp4, mxfp4), sr, on a 4096-wide
    # matrix cut from the same tensor (at most 64 MiB: it is slower), its scales computed beforehand.
    grid = flat[: min(flat.size, 16 << 20) // 4096 * 4096].reshape(-1, 4096)
    scaled_gbps = {}
    for fmt in ("fp8_e4m3", *rounding.MICROSCALED):
        f = rounding.FORMATS[fmt]
        scales = rounding.fp8_scales(grid, f, "block")
        served = np.empty(f.nbytes(grid.size), np.uint8)
        spec = rounding.ExportSpec(fmt, "sr", fp8_pattern=".*")
        seconds = timed(functools.partial(rounding.export_array, grid.reshape(-1), served, spec, version=1, name="w",
                                          fmt=f, scales=scales))
        scaled_gbps[f"kernel_{fmt}_sr_gbps"] = round(grid.nbytes / seconds / 1e9, 2)
    return {
        **scaled_gbps,
        "K1": round(cast_s / sr_s, 3),
        "K2": round(cast_s / ef_s, 3),
        "K1_vs_torch_ops_sr": round(torch_sr_s / sr_s, 2),
        "kernel_cast_gbps": round(x.numel() * 4 / cast_s / 1e9, 2),
        "kernel_sr_gbps": round(x.numel() * 4 / sr_s / 1e9, 2),
        "kernel_ef_gbps": round(x.numel() * 4 / ef_s / 1e9, 2),
        "kernel_torch_ops_sr_gbps": round(x.numel() * 4 / torch_sr_s / 1e9, 2),
    }


def kernels_part(*, repeat: int, say: Callable[[str], Any]) -> dict[str, Any]:
    """K1, K2 and K1_vs_torch_ops_sr with their rows; the GB/s behind them in details."""
    say("kernels: K1/K2 on a 256 MiB fp32 tensor")
    kernels = kernel_bench(repeat=repeat)
    return {
        **{k: v for k, v in kernels.items() if not k.startswith("kernel_")},
        "details": {k: v for k, v in kernels.items() if k.startswith("kernel_")},
        "report": {
            "K1": row("fused sr bf16 export vs x.to(bfloat16)", f"{kernels['K1']:.2f}x", ">= 0.8x"),
            "K2": row("fused ef bf16 export vs x.to(bfloat16)", f"{kernels['K2']:.2f}x", ">= 0.4x"),
            "K1_vs_torch_ops_sr": row("fused sr vs sr composed from torch ops",
                                      f"{kernels['K1_vs_torch_ops_sr']:.1f}x faster"),
        },
    }
