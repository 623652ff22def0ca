"""The benches of a CUDA machine (scripts/gpu_check.sh): K1/K2/K3 of the Triton kernels on the GPU,
where their time goes for each launch shape, and a push to a server with --device cuda."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsvc.cli.bench._common import best, make_model, serve
from weightsvc.cli.bench.rawtcp import raw_tcp_seconds
from weightsvc.client import LearnerClient


def _timer(device: str, repeat: int) -> Callable[[Callable[[], object]], float]:
    """Best-of-`repeat` seconds of a GPU call, waiting for the device (a warm-up call first)."""

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()

        def once() -> float:
            start = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - start

        return best(once, repeat)

    return timed


def cuda_kernel_bench(*, size_mib: float = 1024, repeat: int = 10, device: str = "cuda") -> dict[str, Any]:
    """K1/K2/K3 on a CUDA device: the Triton export kernels vs `x.to(torch.bfloat16)` on the GPU, plus
    `rounding.export` as the service calls it (for ef that includes the residual's trip to the host).
    (`device="cpu"` runs it under Triton's interpreter: to check the code path, not for figures.)"""
    from weightsvc import rounding
    from weightsvc.rounding import _triton

    x = torch.randn(int(size_mib * (1 << 20)) // 4, device=device) * 0.02
    out = torch.empty(x.numel(), dtype=torch.bfloat16, device=device).view(torch.int16)
    res_in, res_out = torch.zeros_like(x), torch.empty_like(x)
    spec_sr, spec_ef = rounding.ExportSpec("bf16", "sr"), rounding.ExportSpec("bf16", "ef")
    k0, k1 = spec_sr.key(1, "w")
    residual = rounding.Residual()
    timed = _timer(device, repeat)
    on = "cuda" if device == "cuda" else "auto"  # (the interpreter: rounding.export's CPU path)
    cast_s = timed(lambda: x.to(torch.bfloat16))
    sr_s = timed(lambda: _triton.bf16_export(x, out, k0, k1, 0, True, None, None))
    ef_s = timed(lambda: _triton.bf16_export(x, out, k0, k1, 0, spec_ef.stochastic, res_in, res_out))
    api_sr_s = timed(lambda: rounding.export(x, spec_sr, version=1, name="w", device=on))
    api_ef_s = timed(lambda: rounding.export(x, spec_ef, version=1, name="w", residual=residual, device=on))
    # fp8 with 128x128 blocks, scales computed on the GPU, as the service exports a weight
    grid = x.view(-1, 2048)
    spec_fp8 = rounding.ExportSpec("fp8_e4m3", "sr", scaling="block", fp8_pattern=".*")
    fp8_s = timed(lambda: rounding.export(grid, spec_fp8, version=1, name="w", device=on))
    # the microscaled formats the same way: block scales on the GPU, FP4 packed there
    micro_s = {}
    for fmt in rounding.MICROSCALED:
        spec = rounding.ExportSpec(fmt, "sr", fp8_pattern=".*")
        micro_s[fmt] = timed(functools.partial(rounding.export, grid, spec, version=1, name="w", device=on))
    gbps = {k: round(x.numel() * 4 / v / 1e9, 1) for k, v in
            {"cast": cast_s, "sr": sr_s, "ef": ef_s, "export_sr": api_sr_s, "export_ef": api_ef_s,
             "fp8_block_sr": fp8_s, **{f"{fmt}_sr": v for fmt, v in micro_s.items()}}.items()}
    return {
        "K1_cuda": round(cast_s / sr_s, 3),
        "K2_cuda": round(cast_s / ef_s, 3),
        "K3_cuda_fp8_block_sr": round(cast_s / fp8_s, 3),
        **{f"K3_cuda_{fmt}_sr": round(cast_s / v, 3) for fmt, v in micro_s.items()},
        "K1_cuda_export_api": round(cast_s / api_sr_s, 3),
        "K2_cuda_export_api": round(cast_s / api_ef_s, 3),
        **{f"kernel_cuda_{k}_gbps": v for k, v in gbps.items()},
        "device": torch.cuda.get_device_name() if device == "cuda" else "triton-interpreter",
    }


# Launches the profile tries: (elements per program, warps per program).
LAUNCHES = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16))


def cuda_kernel_profile(*, size_mib: float = 1024, repeat: int = 5, device: str = "cuda") -> dict[str, Any]:
    """Where the export kernels' time goes, for each launch in LAUNCHES: GB/s of fp32 for a plain cast,
    bf16 rtn (no hash), sr, sr without its counters (the cost of the reductions and atomics), ef,
    and fp8 sr with one tensor scale (the generic kernel). The fastest launch for sr is reported;
    the launch in use (`_triton.LAUNCH`) is put back afterwards."""
    from weightsvc.rounding import FORMATS, _cpu, _triton

    x = torch.randn(int(size_mib * (1 << 20)) // 4, device=device) * 0.02
    out16 = torch.empty(x.numel(), dtype=torch.int16, device=device)
    out8 = torch.empty(x.numel(), dtype=torch.uint8, device=device)
    res_in, res_out = torch.zeros_like(x), torch.empty_like(x)
    one = torch.ones(1, device=device)
    timed = _timer(device, repeat)
    calls: dict[str, Callable[[], object]] = {
        "rtn": lambda: _triton.bf16_export(x, out16, 1, 2, 0, False),
        "sr": lambda: _triton.bf16_export(x, out16, 1, 2, 0, True),
        "sr_uncounted": lambda: _triton.bf16_export(x, out16, 1, 2, 0, True, count=False),
        "ef": lambda: _triton.bf16_export(x, out16, 1, 2, 0, False, res_in, res_out),
        "fp8_sr": lambda: _triton.float_export(x, out8, 1, 2, 0, True, FORMATS["fp8_e4m3"], one,
                                               _cpu.SCALE_TENSOR, 1, 1),
    }
    nbytes = x.numel() * 4
    result: dict[str, Any] = {"profile_cast_gbps": round(nbytes / timed(lambda: x.to(torch.bfloat16)) / 1e9, 1)}
    in_use = dict(_triton.LAUNCH)
    fastest: tuple[float, str] = (0.0, "")
    try:
        for block, warps in LAUNCHES:
            _triton.LAUNCH.update(block=block, num_warps=warps)
            for what, call in calls.items():
                gbps = round(nbytes / timed(call) / 1e9, 1)
                result[f"profile_{block}x{warps}_{what}_gbps"] = gbps
                if what == "sr":
                    fastest = max(fastest, (gbps, f"{block}x{warps}"))
    finally:
        _triton.LAUNCH.update(in_use)
    result["profile_best_sr_launch"] = fastest[1]
    result["profile_launch_in_use"] = f"{in_use['block']}x{in_use['num_warps']}"
    return result


def device_push_bench(*, size_mib: int = 4096, repeat: int = 2, rounding: str = "sr",
                      small: int = 20_000) -> dict[str, Any]:
    """K3's service side: a push of a `size_mib` fp32 model to a server with `--device cuda` and to
    one with `--device cpu`, against raw TCP moving the same bytes (the network alone). Export
    hidden behind receipt: K3_push_cuda_vs_tcp near 1. Also the push of `small` tensors of 1024
    elements each (norms, biases: exported many to a launch), in µs per tensor."""
    model = make_model(size_mib)
    nbytes = sum(t.numel() * 4 for t in model.values())
    many_model = {f"t.{i}": t for i, t in enumerate((torch.randn(small, 1024) * 0.02).unbind(0))}
    out: dict[str, Any] = {"K3_push_mib": size_mib, "K3_push_rounding": rounding}
    tcp = best(lambda: raw_tcp_seconds(nbytes, download=False), repeat)
    out["K3_push_tcp_s"] = round(tcp, 3)
    for device in ("cuda", "cpu"):
        server = serve(2, "--device", device, "--rounding", rounding)
        try:
            with LearnerClient(server.target) as learner:
                learner.push(0, model, "bench")  # warm: buffers mapped, kernels compiled
                seconds = []
                for step in range(1, 1 + repeat):
                    start = time.perf_counter()
                    learner.push(step, model, "bench")
                    seconds.append(time.perf_counter() - start)
                out[f"K3_push_{device}_s"] = round(min(seconds), 3)
                learner.push(0, many_model, "small")
                start = time.perf_counter()
                learner.push(1, many_model, "small")
                out[f"K3_small_push_{device}_us_per_tensor"] = round((time.perf_counter() - start) / small * 1e6, 1)
        finally:
            server.stop()
    out["K3_push_cuda_vs_tcp"] = round(out["K3_push_tcp_s"] / out["K3_push_cuda_s"], 3)
    out["K3_push_cpu_vs_tcp"] = round(out["K3_push_tcp_s"] / out["K3_push_cpu_s"], 3)
    return out
