"""The Triton kernels (run here by Triton's interpreter) give the CPU kernels' bits, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.exact_rounding import grid
from weightsvc.rounding import FORMATS, ExportSpec, _cpu, export_array, export_tensor, fp8_scales

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
    triton_kernels.float_export(torch.from_numpy(m), gpu, k0, k1, 0, True, f, one,
                                scales.mode if scales else 0, 1, 1)
    assert np.array_equal(cpu.view(gpu.numpy().dtype), gpu.numpy())
    assert np.count_nonzero(cpu.view(gpu.numpy().dtype)[1:]) > 100  # some did round up, away from 0


def ties_under_scales(fmt: str, amaxes: tuple[float, ...], width: int) -> np.ndarray:
    """Rows of `width`: row j's max is amaxes[j], with every value and midpoint of the format times
    amax / format max (the row's scale, or near it), rounded to fp32, and the fp32 numbers beside
    them."""
    values = np.array([float(v) for v in grid(fmt)])
    quotients = np.concatenate([values, (values[:-1] + values[1:]) / 2])
    rows = np.zeros((len(amaxes), width), np.float32)
    for j, amax in enumerate(amaxes):
        exact = (np.concatenate([quotients, -quotients]) * (amax / values[-1])).astype(np.float32)
        with np.errstate(over="ignore"):  # beside the fp32 max: Inf, left out below
            probes = np.concatenate([exact, np.nextafter(exact, np.float32(np.inf)),
                                     np.nextafter(exact, np.float32(-np.inf))])
        probes = np.resize(probes[np.abs(probes) <= np.float32(amax)], width - 1)
        rows[j] = np.concatenate([[amax], probes])
    return rows


@pytest.mark.parametrize("fmt, scaling, amaxes", [
    ("fp8_e4m3", "channel", (784.0, 0.0123, 3.1e-5, 2.0)),
    ("fp8_e5m2", "block", (1e4, 0.0123)),
    ("nvfp4", "block", (10.5, 10.5, 10.0, 1.3)),  # the max's blocks: scale 448 / gs (1.75 where amax is 10.5)
    ("mxfp8", "block", (3.4028235e38, 3.3e38, 3.0e38, 1.0)),  # near the fp32 max: the capped scales
    ("mxfp4", "block", (3.4028235e38, 3.3e38, 2.9e38, 1.0)),
])
@pytest.mark.parametrize("rounding", ["rtn", "sr", "ef"])
def test_ties_under_scales_agree(fmt: str, scaling: str, amaxes: tuple[float, ...], rounding: str) -> None:
    """The exact rounding of u / scale (the division, its remainder in float64, the step to odd) and
    the capped MX scales give the CPU kernel's bits on ties, near ties and values near the fp32 max."""
    f = FORMATS[fmt]
    m = ties_under_scales(fmt, amaxes, 2048)
    res = np.random.default_rng(3).normal(0, 1e-3, m.size).astype(np.float32)
    ef = rounding == "ef"
    spec = ExportSpec(fmt, rounding, seed=2, scaling=scaling, fp8_pattern=".*")
    scales = fp8_scales(m + res.reshape(m.shape) if ef else m, f, scaling)
    flat = m.reshape(-1)
    cpu = np.empty(f.nbytes(flat.size), np.uint8)
    cpu_res = np.empty_like(res)
    export_array(flat, cpu, spec, version=3, name="w", fmt=f, scales=scales, residual=res, new_residual=cpu_res)
    gpu = torch.empty(f.nbytes(flat.size), dtype=torch.uint8)
    gpu_res = torch.empty(flat.size, dtype=torch.float32)
    export_tensor(torch.from_numpy(flat.copy()), gpu, spec, f, version=3, name="w", scales=scales,
                  residual=torch.from_numpy(res) if ef else None, new_residual=gpu_res if ef else None)
    assert np.array_equal(cpu, gpu.numpy())
    if ef:
        assert np.array_equal(cpu_res.view(np.uint32), gpu_res.numpy().view(np.uint32))
