"""The Triton kernels (run here by Triton's interpreter) give the CPU kernels' bits, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightsvc.rounding import FORMATS, ExportSpec, _cpu, export_array, fp8_scales

triton_kernels = pytest.importorskip("weightsvc.rounding._triton", reason="needs triton (the dev extra, Linux x86_64)")

N_ROWS, N_COLS = 130, 260  # spans two 128-blocks in each direction


def masters() -> np.ndarray:
    gen = np.random.default_rng(7)
    values = gen.normal(0, 0.02, N_ROWS * N_COLS).astype(np.float32)
    raw = gen.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values[:2000] = raw  # every kind of bit pattern: NaN, Inf, subnormals, huge
    values[2000:2010] = [0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 448.0, 500.0, 65504.0, 7e4]
    return values


def test_hash_matches_a_pure_python_lowbias32() -> None:
    from numba import njit

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @njit
    def bits(k0, k1, idx):  # type: ignore[no-untyped-def]
        return _cpu.random_bits(k0, k1, idx)

    for k0, k1, idx in [(5, 7, 3), (0xFFFFFFFF, 1, 2**40 + 17), (123, 0xDEADBEEF, 0)]:
        expected = mix(mix((idx & 0xFFFFFFFF) ^ k0) ^ (((idx >> 32) + k1) & 0xFFFFFFFF))
        assert bits(np.uint32(k0), np.uint32(k1), np.uint64(idx)) == expected


@pytest.mark.parametrize("rounding", ["rtn", "sr", "sr-sticky", "ef"])
def test_bf16_kernel(rounding: str) -> None:
    m = masters()
    spec = ExportSpec("bf16", rounding, seed=11)
    cpu = np.empty(m.size * 2, np.uint8)
    res = np.random.default_rng(1).normal(0, 1e-4, m.size).astype(np.float32)
    cpu_res = np.empty_like(res)
    export_array(m, cpu, spec, version=5, name="w", offset=9, residual=res, new_residual=cpu_res)
    gpu = torch.empty(m.size, dtype=torch.int16)
    k0, k1 = spec.key(5, "w")
    ef = rounding == "ef"
    gpu_res = torch.empty(m.size, dtype=torch.float32)
    triton_kernels.bf16_export(torch.from_numpy(m.copy()), gpu, k0, k1, 9, spec.stochastic,
                               torch.from_numpy(res) if ef else None, gpu_res if ef else None)
    assert np.array_equal(cpu.view(np.uint16), gpu.numpy().view(np.uint16))
    if ef:
        assert np.array_equal(cpu_res.view(np.uint32), gpu_res.numpy().view(np.uint32))


@pytest.mark.parametrize("rounding", ["rtn", "sr", "sr-sticky"])
def test_many_small_runs_in_one_launch(rounding: str) -> None:
    """`Exporter.export_runs` on the device (one launch for all the runs) gives `rounding.export_runs`'
    bits and per-run counts: runs of one element, of a block, of a block and one, empty ones, runs
    starting mid-tensor, NaN/Inf and saturating values in some of them."""
    from weightsvc.rounding import export_runs
    from weightsvc.service.device import Exporter

    m = masters()
    lengths = [1, 1024, 1025, 0, 3000, 7, 2048, 0, 1]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    m = np.concatenate([m[8000 : 8000 + starts[-1] - 4000], m[:4000]])  # raw bit patterns in the last runs
    names = [f"t{j}" for j in range(len(lengths))]
    offsets = [0, 5, 1 << 33, 0, 17, 0, 4096, 3, 1]
    outs = starts[-1] - starts[1:]  # the runs in reverse order in the data section
    spec = ExportSpec("bf16", rounding, seed=4)
    cpu, gpu = (np.zeros(starts[-1] + 8, np.uint16) for _ in range(2))
    expected = export_runs(m, starts, cpu, spec, version=3, names=names, offsets=offsets, outs=outs)
    got = Exporter("cuda-interpreted", "cpu").export_runs(m, starts, gpu, spec, version=3, names=names,
                                                       offsets=offsets, outs=outs)
    assert np.array_equal(cpu, gpu)
    assert got == expected and sum(s.nonfinite for s in got) > 0 and sum(s.saturated for s in got) > 0


@pytest.mark.parametrize("fmt, scaling", [("fp16", None), ("fp8_e4m3", "tensor"), ("fp8_e4m3", "block"),
                                          ("fp8_e5m2", "channel")])
@pytest.mark.parametrize("rounding", ["rtn", "sr", "ef"])
@pytest.mark.parametrize("cols", [N_COLS, 256])  # rows of a power-of-two length: shifts, not divisions
def test_float_kernel(fmt: str, scaling: str | None, rounding: str, cols: int) -> None:
    """A chunk from mid-row to the end of a tensor (offset 300: not a multiple of a row)."""
    f = FORMATS[fmt]
    m = masters()[: N_ROWS * cols]
    if f.scaled:
        m[:2100] = np.nan_to_num(m[:2100], nan=0.0, posinf=1.0, neginf=-1.0).clip(-1, 1)
    spec = ExportSpec(fmt, rounding, seed=3, scaling=scaling or "block")
    res = np.random.default_rng(2).normal(0, 1e-3, m.size).astype(np.float32)
    scales = fp8_scales((m + res).reshape(N_ROWS, cols), f, spec.scaling) if f.scaled else None
    at = 300
    m, res = m[at:], res[at:]
    cpu = np.empty(m.size * f.itemsize, np.uint8)
    cpu_res = np.empty_like(res)
    export_array(m, cpu, spec, version=2, name="x.weight", fmt=f, offset=at, scales=scales, residual=res,
                 new_residual=cpu_res)
    ef = rounding == "ef"
    k0, k1 = spec.key(2, "x.weight")
    gpu = torch.empty(m.size, dtype=torch.int16 if f.width == 16 else torch.uint8)
    gpu_res = torch.empty(m.size, dtype=torch.float32)
    one = torch.ones(1)
    triton_kernels.float_export(
        torch.from_numpy(m.copy()), gpu, k0, k1, at, spec.stochastic, f,
        torch.from_numpy(scales.inverse) if scales else one,
        torch.from_numpy(scales.scale_inv.reshape(-1).copy()) if scales else one,
        scales.mode if scales else 0, scales.cols if scales else 1, scales.block_cols if scales else 1,
        torch.from_numpy(res) if ef else None, gpu_res if ef else None,
    )
    assert np.array_equal(cpu.view(gpu.numpy().dtype), gpu.numpy())
    if ef:
        assert np.array_equal(cpu_res.view(np.uint32), gpu_res.numpy().view(np.uint32))


@pytest.mark.parametrize("fmt", ["fp16", "fp8_e4m3", "fp8_e5m2"])
def test_far_subnormal_sr_agrees(fmt: str) -> None:
    """sr of values far below the format's smallest subnormal, where all of the significand and
    more is discarded: s (the bits dropped) around 32, where the kernels switch from adding random
    bits to comparing with them, and far beyond."""
    f = FORMATS[fmt]
    gen = np.random.default_rng(5)
    exps = np.arange(f.emin - f.mantissa - 12, f.emin - f.mantissa - 5)  # s = 23 - mantissa + emin - e: 28 ... 35
    m = np.concatenate([np.ldexp(gen.uniform(1, 2, 2000), e) for e in [*exps, -97]]).astype(np.float32)
    m *= np.where(gen.random(m.size) < 0.5, -1, 1).astype(np.float32)
    m[0] = f.max_value  # a tensor scale of 1
    spec = ExportSpec(fmt, "sr", seed=1, scaling="tensor", fp8_pattern=".*")
    scales = fp8_scales(m.reshape(1, -1), f, "tensor") if f.scaled else None
    assert scales is None or float(scales.scale_inv.reshape(-1)[0]) == 1.0
    cpu = np.empty(m.size * f.itemsize, np.uint8)
    export_array(m, cpu, spec, version=1, name="w", fmt=f, scales=scales)
    gpu = torch.empty(m.size, dtype=torch.int16 if f.width == 16 else torch.uint8)
    k0, k1 = spec.key(1, "w")
    one = torch.ones(1)
    triton_kernels.float_export(torch.from_numpy(m), gpu, k0, k1, 0, True, f, one, one,
                                scales.mode if scales else 0, 1, 1)
    assert np.array_equal(cpu.view(gpu.numpy().dtype), gpu.numpy())
    assert np.count_nonzero(cpu.view(gpu.numpy().dtype)[1:]) > 100  # some did round up, away from 0
