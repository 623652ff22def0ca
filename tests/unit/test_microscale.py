"""Microscaled formats (mxfp8, nvfp4, mxfp4) against independent oracles: ml_dtypes for the element
and scale encodings, exact float64 arithmetic for the scale rules, exact fractions for the quotient
x / scale that rtn and sr round, sample-size bounds for sr."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.exact_rounding import differences, grid, half_even_codes, quotients
from weightsvc.rounding import (
    FORMATS,
    ExportSpec,
    ExportStats,
    Residual,
    Scales,
    block_scale_values,
    block_scales,
    block_scales_torch,
    decode,
    dequantize,
    element_scales,
    export_array,
    export_state_dict,
    fp8_scales,
    pack,
    served_tensors,
    unpack,
)

MICRO = ["mxfp8", "nvfp4", "mxfp4"]
ELEMENT_DTYPE = {"mxfp8": ml_dtypes.float8_e4m3fn, "nvfp4": ml_dtypes.float4_e2m1fn, "mxfp4": ml_dtypes.float4_e2m1fn}
SCALE_DTYPE = {"mxfp8": ml_dtypes.float8_e8m0fnu, "nvfp4": ml_dtypes.float8_e4m3fn, "mxfp4": ml_dtypes.float8_e8m0fnu}


def element_values(fmt: str) -> np.ndarray:
    """Every finite non-negative element value, increasing (from ml_dtypes, not our decoder)."""
    width = FORMATS[fmt].width
    codes = np.arange(1 << (width - 1), dtype=np.uint8)
    values = codes.view(ELEMENT_DTYPE[fmt]).astype(np.float32)
    return np.unique(values[np.isfinite(values)])


def oracle_codes(y: np.ndarray, fmt: str) -> np.ndarray:
    """Round to nearest even by ml_dtypes, one code per element (|y| <= the element max)."""
    codes = y.astype(ELEMENT_DTYPE[fmt]).view(np.uint8)
    return codes & 0xF if FORMATS[fmt].width == 4 else codes


def export_codes(
    master: np.ndarray,
    fmt: str,
    rounding: str = "rtn",
    *,
    version: int = 1,
    name: str = "x.weight",
    scales: Scales | None = None,
    residual: np.ndarray | None = None,
    offset: int = 0,
) -> tuple[np.ndarray, ExportStats, np.ndarray]:
    """(one code per element, stats, new residual) of a flat master (or a chunk at `offset`)."""
    f = FORMATS[fmt]
    flat = master.astype(np.float32).reshape(-1)
    out = np.empty(f.nbytes(flat.size), np.uint8)
    res = residual if residual is not None else np.zeros(flat.size, np.float32)
    new_res = np.empty_like(res)
    assert scales is not None or master.ndim == 2
    stats = export_array(flat, out, ExportSpec(fmt, rounding, seed=5), version=version, name=name, fmt=f,
                         offset=offset, scales=scales or block_scales(master, f), residual=res,
                         new_residual=new_res)
    return (unpack(out) if f.packed else out), stats, new_res


def block_scale_of(master: np.ndarray, scales: Scales) -> np.ndarray:
    """The served fp32 scale of each element's block, shaped like master."""
    assert scales.codes is not None
    return np.repeat(scales.scale_inv.reshape(-1), scales.cols).reshape(master.shape)


def power_of_two_y(master: np.ndarray, scales: Scales) -> np.ndarray:
    """x / scale where every scale is a power of two: exact in float64."""
    scale = block_scale_of(master, scales).astype(np.float64)
    mantissa, _ = np.frexp(scale)
    assert np.all(mantissa == 0.5)
    return master.astype(np.float64) / scale


def probe_rows(fmt: str) -> np.ndarray:
    """Rows of one block each at power-of-two scales, holding every representable value and every
    midpoint (a tie), both signs, and the element max (which pins the block's scale)."""
    f = FORMATS[fmt]
    values = element_values(fmt)
    grid = np.concatenate([values, (values[:-1] + values[1:]) / 2])  # exact in fp32
    grid = np.concatenate([grid, -grid])
    per_row = f.block - 1
    chunks = [grid[i : i + per_row] for i in range(0, grid.size, per_row)]
    rows = []
    for exponent in (-20, -3, 0, 5):
        for chunk in chunks:
            row = np.zeros(f.block, np.float32)
            row[0] = f.max_value
            row[1 : 1 + chunk.size] = chunk
            rows.append(np.ldexp(row, exponent).astype(np.float32))
    return np.stack(rows)


@pytest.mark.parametrize("fmt", MICRO)
def test_rtn_rounds_every_value_and_tie_as_ml_dtypes(fmt: str) -> None:
    master = probe_rows(fmt)
    scales = block_scales(master, FORMATS[fmt])  # MX: powers of two; nvfp4: gs 14, block scales 14 * 2^j or 2^-9
    codes, stats, _ = export_codes(master, fmt, scales=scales)
    scale = block_scale_of(master, scales)
    expected = half_even_codes(master, scale, fmt).reshape(-1)
    assert np.array_equal(codes, expected), differences(master, codes, expected)
    assert stats.saturated == 0 and stats.nonfinite == 0
    values = grid(fmt)
    midpoints = {(a + b) / 2 for a, b in itertools.pairwise(values)}
    ties = sum(q in midpoints for q in quotients(master, scale))
    assert ties >= 2 * (len(values) - 1)  # the ties really were probed


bit_patterns = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=32, max_size=32)


@pytest.mark.parametrize("fmt", MICRO)
@settings(max_examples=60, deadline=None)
@given(patterns=bit_patterns, tiny=st.booleans())
def test_rtn_of_any_finite_block_is_ml_dtypes_given_the_scale(fmt: str, patterns: list[int], tiny: bool) -> None:
    master = np.array(patterns, np.uint32).view(np.float32).reshape(1, 32).copy()
    master[~np.isfinite(master)] = 0
    np.clip(master, -2.5e38, 2.5e38, out=master)  # below the MX scales' cap (test_near_the_fp32_max_...)
    if tiny:  # subnormal fp32 blocks and the bottom of the scale range
        master *= np.float32(2.0**-100)
    f = FORMATS[fmt]
    scales = block_scales(master, f)
    codes, stats, _ = export_codes(master, fmt, scales=scales)
    scale = block_scale_of(master, scales)
    # no element clips (NVFP4's block max may lie above 6 * scale by < 2^-23: it rounds to 6)
    assert np.all(np.abs(master.astype(np.float64)) <= f.max_value * scale * (1 + 2.0**-23))
    expected = half_even_codes(master, scale, fmt).reshape(-1)
    assert np.array_equal(codes, expected), differences(master, codes, expected)
    assert stats.saturated == 0


@pytest.mark.parametrize("fmt", MICRO)
def test_scale_codes_decode_to_what_the_kernels_use(fmt: str) -> None:
    f = FORMATS[fmt]
    master = (np.random.default_rng(0).normal(0, 1, (16, 64)) * np.logspace(-30, 30, 64)).astype(np.float32)
    master[3, : f.block] = 0
    scales = block_scales(master, f)
    assert scales.codes is not None and scales.codes.shape == (16, 64 // f.block) and scales.codes.dtype == np.uint8
    oracle = scales.codes.view(SCALE_DTYPE[fmt]).astype(np.float32)
    if f.global_scale:
        assert scales.global_scale is not None
        oracle = oracle / scales.global_scale[0]
    assert np.array_equal(scales.scale_inv, oracle)
    assert np.array_equal(block_scale_values(scales.codes, f, scales.global_scale), oracle)
    idx = np.arange(master.size)
    assert np.array_equal(element_scales(scales, idx), scales.scale_inv.reshape(-1)[idx // f.block])


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_mx_scale_is_the_smallest_power_of_two_that_clips_nothing(fmt: str) -> None:
    """... below the largest scale whose every element value is a finite fp32 (2^119 for mxfp8,
    2^125 for mxfp4): a block with a larger max gets that one, and its max saturates."""
    f = FORMATS[fmt]
    with np.errstate(over="ignore"):
        e_max = max(e for e in range(128) if np.isfinite(np.float32(np.ldexp(f.max_value, e))))
    gen = np.random.default_rng(1)
    exact = np.ldexp(np.float32(f.max_value), np.arange(-130, 118)).astype(np.float32)
    amax = np.concatenate([
        np.ldexp(gen.uniform(0.5, 1, 500), gen.integers(-149, 128, 500)),
        exact,  # exactly elem_max * 2^e: that e
        np.nextafter(exact, np.float32(np.inf)),  # just above: one more
        [2.0**-149, 3.4028235e38, 0.0],
    ]).astype(np.float32)
    master = np.zeros((amax.size, f.block), np.float32)
    master[:, 7] = amax * np.where(np.arange(amax.size) % 2, -1, 1)  # the sign does not matter
    master[:, 8] = amax / 3
    scales = block_scales(master, f)
    assert scales.codes is not None
    e = scales.codes[:, 0].astype(np.int64) - 127
    a = amax.astype(np.float64)
    fits = a <= np.ldexp(f.max_value, e)
    assert np.all(fits | (e == e_max)) and 0 < (~fits).sum() < 5  # no element clips below the cap
    assert np.all((a > np.ldexp(f.max_value, e - 1)) | (e == -127) | (a == 0))  # the smallest such
    assert np.all(e[a == 0] == 0) and np.all(e >= -127) and np.all(e <= e_max)
    at = slice(500, 500 + exact.size)
    in_range = exact >= np.ldexp(f.max_value, -127)
    assert np.array_equal(np.ldexp(f.max_value, e[at])[in_range], exact[in_range])  # exactly elem_max * 2^e: e
    _, stats, _ = export_codes(master, fmt, "sr", scales=scales)
    assert stats.saturated == (~fits).sum()


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_mx_zero_block_gets_scale_one(fmt: str) -> None:
    f = FORMATS[fmt]
    master = np.zeros((2, 2 * f.block), np.float32)
    master[0, 1] = -0.0
    master[1, f.block :] = 1.0
    master[1, 3] = np.nan  # non-finite values do not count in the block max
    scales = block_scales(master, f)
    assert scales.codes is not None
    # 1.0: 2^-8 x 448 (mxfp8), 2^-2 x 6 (mxfp4)
    assert scales.codes.tolist() == [[127, 127], [127, 119 if fmt == "mxfp8" else 125]]
    codes, stats, _ = export_codes(master, fmt, scales=scales)
    sign = 0x80 if f.width == 8 else 0x8
    assert codes[0] == 0 and codes[1] == sign and np.all(codes[2 : f.block] == 0)  # -0 keeps its sign
    assert stats.nonfinite == 1


def test_nvfp4_global_and_block_scales() -> None:
    f = FORMATS["nvfp4"]
    gen = np.random.default_rng(2)
    master = (gen.normal(0, 0.02, (32, 64)) * np.logspace(-6, 2, 64)).astype(np.float32)
    master[5, 16:32] = 0
    master[6, 0] = np.inf  # ignored by the maxima
    scales = block_scales(master, f)
    assert scales.codes is not None and scales.global_scale is not None
    finite = np.where(np.isfinite(master), master, 0)
    tensor_amax = np.float32(np.abs(finite).max())
    gs = scales.global_scale[0]
    assert gs == np.float32(2688) / tensor_amax and scales.global_scale.dtype == np.float32
    block_amax = np.abs(finite).reshape(32, 4, 16).max(axis=2).astype(np.float64)
    target = block_amax / 6 * np.float64(gs)
    value = scales.codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    below = np.where(scales.codes > 0, scales.codes - 1, 0).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    assert np.all(value >= np.minimum(target, 448))  # rounded up: no element clips
    assert np.all((below.astype(np.float64) < target) | (scales.codes == 0))  # the smallest such
    assert scales.codes[5, 1] == 0 and scales.scale_inv[5, 1] == 0
    codes, stats, _ = export_codes(master, "nvfp4", "sr", scales=scales)
    assert stats.saturated == 0 and stats.nonfinite == 1
    assert np.all(codes.reshape(32, 64)[5, 16:32] == 0)


def test_nvfp4_all_zero_tensor() -> None:
    master = np.zeros((2, 32), np.float32)
    master[1, 5] = -0.0
    scales = block_scales(master, FORMATS["nvfp4"])
    assert scales.global_scale is not None and scales.codes is not None
    assert scales.global_scale.tolist() == [1.0] and not scales.codes.any()
    codes, stats, res = export_codes(master, "nvfp4", "ef", scales=scales)
    assert codes[37] == 0x8 and np.count_nonzero(codes) == 1  # -0 keeps its sign
    assert not res.any() and stats == ExportStats(0, 0)


def test_nvfp4_tiny_tensor_keeps_finite_scales() -> None:
    master = np.full((1, 16), 1e-38, np.float32)
    master[0, 0] = 1e-44
    scales = block_scales(master, FORMATS["nvfp4"])
    assert np.isfinite(scales.scale_inv).all() and np.all(scales.scale_inv > 0)
    codes, stats, _ = export_codes(master, "nvfp4", scales=scales)
    assert stats.saturated == 0
    assert np.array_equal(codes, half_even_codes(master, block_scale_of(master, scales), "nvfp4").reshape(-1))


def scaled_ties(fmt: str, scale: float) -> np.ndarray:
    """Every element value and midpoint (both signs) times `scale`, rounded to fp32, and the fp32
    numbers beside each: exact ties where the products are exact, near ties around them."""
    values = element_values(fmt).astype(np.float64)
    grid = np.concatenate([values, (values[:-1] + values[1:]) / 2])
    exact = (np.concatenate([grid, -grid]) * scale).astype(np.float32)
    return np.concatenate([exact, np.nextafter(exact, np.float32(np.inf)), np.nextafter(exact, np.float32(-np.inf))])


@pytest.mark.parametrize("amax", [10.5, 1.0, 0.0123, 3.1e-5])
def test_nvfp4_rtn_is_half_to_even_where_the_block_max_is_six_times_its_scale(amax: float) -> None:
    """Blocks holding the tensor's max have block scale 448 and a multiplier 448 / gs whose fp32
    reciprocal is inexact. amax 10.5: gs 256, multiplier exactly 1.75, so 1.3125, 3.0625 and 6.125
    are exact ties (0.75, 1.75, 3.5 times it) and go to the even 1, 2 and 4; the other maxima give
    multipliers of 24 bits, and near ties on either side of each midpoint."""
    f = FORMATS["nvfp4"]
    scale = float(np.float32(448) / (np.float32(2688) / np.float32(amax)))
    probes = scaled_ties("nvfp4", scale)
    probes = probes[np.abs(probes) <= np.float32(amax)]  # amax stays the tensor's max
    flat = np.zeros((-(-probes.size // 15), 16), np.float32)
    body = np.zeros(flat.shape[0] * 15, np.float32)
    body[: probes.size] = probes
    flat[:, 1:] = body.reshape(-1, 15)
    flat[:, 0] = amax  # every block's max
    scales = block_scales(flat, f)
    assert scales.codes is not None and np.all(scales.codes == 126)  # 448
    assert np.all(scales.scale_inv == np.float32(scale))
    codes, stats, _ = export_codes(flat, "nvfp4", scales=scales)
    expected = half_even_codes(flat, block_scale_of(flat, scales), "nvfp4").reshape(-1)
    assert np.array_equal(codes, expected), differences(flat, codes, expected)
    assert stats.saturated == 0
    if amax == 10.5:
        served = decode(codes, f).reshape(flat.shape)
        assert {x: served[flat == x][0] for x in (1.3125, 3.0625, 6.125, -6.125)} == {
            1.3125: 1.0, 3.0625: 2.0, 6.125: 4.0, -6.125: -4.0}


def test_nvfp4_sr_serves_a_value_on_the_grid_as_itself() -> None:
    """x / scale exactly on the e2m1 grid has one neighbour, itself: sr serves it in every version
    (tensor max 10.5: multiplier 1.75, whose reciprocal is not an fp32)."""
    f = FORMATS["nvfp4"]
    values = element_values("nvfp4")[1:]
    grid = (np.concatenate([values, -values]) * np.float32(1.75)).astype(np.float32)  # exact
    master = np.resize(grid, (1 << 18, 16))
    master[:, 0] = 10.5
    scales = block_scales(master, f)
    assert np.all(scales.scale_inv == np.float32(1.75))
    expected = oracle_codes(master.reshape(-1).astype(np.float64) / 1.75, "nvfp4")  # exactly on the grid
    for version in range(1, 9):
        codes, stats, _ = export_codes(master, "nvfp4", "sr", version=version, scales=scales)
        assert np.array_equal(codes, expected), (version, np.count_nonzero(codes != expected))
        assert stats.saturated == 0


def near_max_masters(fmt: str) -> np.ndarray:
    """Blocks of values from 2e38 to the fp32 max, both signs, each block's max the fp32 max or
    just below it, with small values beside them."""
    f = FORMATS[fmt]
    gen = np.random.default_rng(12)
    top = np.finfo(np.float32).max
    master = (gen.uniform(2e38, top, (4, 4 * f.block)) * gen.choice([-1, 1], (4, 4 * f.block))).astype(np.float32)
    master[:, :: f.block] = [top, -top, np.nextafter(top, np.float32(0)), -3.3e38]
    master[:, 1 :: f.block] = [1.0, -1e30, 0.0, 2.9e38]
    return master


@pytest.mark.parametrize("fmt", MICRO)
@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_near_the_fp32_max_every_served_value_is_finite(fmt: str, rounding: str) -> None:
    """No served value is 2^128: a block whose max is beyond what its scale can serve as a finite
    fp32 saturates there (rtn: half to even of x / scale, saturating at the largest value)."""
    f = FORMATS[fmt]
    master = near_max_masters(fmt)
    out = export_state_dict({"x.weight": torch.from_numpy(master)}, ExportSpec(fmt, rounding), version=1)
    back = dequantize(out, "x.weight", f, master.shape)
    assert np.isfinite(back).all()
    big = np.abs(master) > 1e37
    assert np.array_equal(np.signbit(back[big]), np.signbit(master[big]))
    assert np.all(np.abs(back) <= np.abs(master).astype(np.float64) * 1.5)
    if rounding == "rtn":
        scales = block_scales(master, f)
        codes, _, _ = export_codes(master, fmt, scales=scales)
        expected = half_even_codes(master, block_scale_of(master, scales), fmt).reshape(-1)
        assert np.array_equal(codes, expected), differences(master, codes, expected)


@pytest.mark.parametrize("fmt", MICRO)
def test_ef_near_the_fp32_max_keeps_the_sign_and_a_finite_residual(fmt: str) -> None:
    f = FORMATS[fmt]
    master = near_max_masters(fmt)
    big = np.abs(master) > 1e37
    residual = Residual()
    for step in range(1, 7):
        out = export_state_dict({"x.weight": torch.from_numpy(master)}, ExportSpec(fmt, "ef"), version=step,
                                residual=residual)
        back = dequantize(out, "x.weight", f, master.shape)
        assert np.isfinite(back).all(), step
        assert np.array_equal(np.signbit(back[big]), np.signbit(master[big])), step
        assert np.isfinite(residual.tensors["x.weight"]).all(), step


def signed_grid(fmt: str) -> np.ndarray:
    grid = element_values(fmt).astype(np.float64)
    return np.unique(np.concatenate([-grid, grid]))


def neighbours(y: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """The element values at or below and at or above each y."""
    grid = signed_grid(fmt)
    return grid[np.searchsorted(grid, y, side="right") - 1], grid[np.searchsorted(grid, y, side="left")]


@pytest.mark.parametrize("fmt", MICRO)
def test_sr_is_unbiased_per_element_and_stays_between_neighbours(fmt: str) -> None:
    f = FORMATS[fmt]
    gen = np.random.default_rng(3)
    rows, cols, versions, s = 8, 4 * f.block, 300, np.float32(2.0**-3)
    # y = lo + p (hi - lo) between random neighbours (both signs, subnormals included), p in [0.05, 0.95]
    grid = signed_grid(fmt)
    lower = gen.integers(0, grid.size - 1, (rows, cols))
    p_drawn = gen.uniform(0.05, 0.95, (rows, cols))
    master = ((grid[lower] + p_drawn * (grid[lower + 1] - grid[lower])) * s).astype(np.float32)
    master[:, :: f.block] = f.max_value * s  # every block's max: scale s (nvfp4: gs 448 / s, block scale 448)
    scales = block_scales(master, f)
    assert np.all(scales.scale_inv == s)
    y = power_of_two_y(master, scales).reshape(-1)
    lo, hi = neighbours(y, fmt)
    total = np.zeros(master.size)
    for version in range(1, versions + 1):
        codes, stats, _ = export_codes(master, fmt, "sr", version=version, scales=scales)
        served = decode(codes, f).astype(np.float64)
        assert np.all((served == lo) | (served == hi))
        assert stats.saturated == 0
        total += served
    mean = total / versions
    # Per element: the mean of `versions` draws of {lo, hi} with P(hi) = p, within 5 sigma.
    gap = hi - lo
    p = np.where(gap > 0, (y - lo) / np.where(gap > 0, gap, 1), 0)
    sigma = gap * np.sqrt(p * (1 - p) / versions)
    assert np.all(np.abs(mean - y) <= 5 * sigma)
    # Pooled over the elements: the sum of the errors against its standard deviation.
    assert abs((mean - y).sum() / math.sqrt((sigma**2).sum())) < 5
    assert (y < 0).any() and (y > 0).any() and (np.abs(y) < 2.0**f.emin).any()


@pytest.mark.parametrize("fmt", MICRO)
def test_sr_sticky_keeps_its_thresholds_across_versions(fmt: str) -> None:
    f = FORMATS[fmt]
    master = np.random.default_rng(4).normal(0, 0.02, (64, 4 * f.block)).astype(np.float32)
    scales = block_scales(master, f)
    a, _, _ = export_codes(master, fmt, "sr-sticky", version=1, scales=scales)
    b, _, _ = export_codes(master, fmt, "sr-sticky", version=2, scales=scales)
    c, _, _ = export_codes(master, fmt, "sr", version=1, scales=scales)
    d, _, _ = export_codes(master, fmt, "sr", version=2, scales=scales)
    assert np.array_equal(a, b)
    assert (c != d).mean() > 0.2  # fresh randomness per version moves many elements
    moved = master + np.float32(1e-7)  # a small step (the scales are kept): few sticky elements move
    e, _, _ = export_codes(moved, fmt, "sr-sticky", version=3, scales=scales)
    assert (a != e).mean() < 0.05


@pytest.mark.parametrize("fmt", MICRO)
def test_ef_running_mean_tracks_the_master(fmt: str) -> None:
    f = FORMATS[fmt]
    gen = torch.Generator().manual_seed(0)
    name = "layers.0.weight"
    master = torch.randn(32, 4 * f.block, generator=gen) * 0.02
    residual = Residual()
    spec = ExportSpec(fmt, "ef")
    sum_served = np.zeros(master.shape)
    sum_master = np.zeros(master.shape)
    steps = 30
    for step in range(1, steps + 1):
        master = master + torch.randn(master.shape, generator=gen) * 1e-4
        out = export_state_dict({name: master}, spec, version=step, residual=residual)
        sum_served += dequantize(out, name, f, tuple(master.shape)).astype(np.float64)
        sum_master += master.double().numpy()
    last = residual.tensors[name].reshape(master.shape).astype(np.float64)
    gap = sum_master - sum_served
    tol = steps * 2.0**-24 * 0.2  # the fp32 rounding of m + e, per step
    # The gap of the running sums is the last residual (up to the rounding of m + e) ...
    assert np.allclose(gap, last, rtol=0, atol=tol)
    # ... at most half an element ulp times the block's scale: the running mean is within that over
    # the number of versions.
    layout = [entry[0] for entry in served_tensors(name, tuple(master.shape), f)]
    served_bytes = out[layout[0]].view(torch.uint8).numpy()
    y = decode(unpack(served_bytes) if f.packed else served_bytes, f).astype(np.float64).reshape(master.shape)
    global_scale = out[layout[2]].numpy() if f.global_scale else None
    scale = np.repeat(block_scale_values(out[layout[1]].view(torch.uint8).numpy(), f, global_scale), f.block, axis=1)
    grid = signed_grid(fmt)
    at = np.searchsorted(grid, y)
    assert np.array_equal(grid[at], y)
    below, above = grid[np.maximum(at - 1, 0)], grid[np.minimum(at + 1, grid.size - 1)]
    half_ulp = np.maximum(y - below, above - y) / 2 * scale
    assert np.all(np.abs(gap / steps) <= (half_ulp + tol) / steps)


@pytest.mark.parametrize("fmt", MICRO)
def test_non_finite_masters(fmt: str) -> None:
    f = FORMATS[fmt]
    master = np.full((1, f.block), 0.5, np.float32)
    master[0, :5] = [np.nan, -np.nan, np.inf, -np.inf, 1.0]
    with_specials = block_scales(master, f)
    finite_only = block_scales(np.where(np.isfinite(master), master, 0).astype(np.float32), f)
    assert np.array_equal(with_specials.scale_inv, finite_only.scale_inv)  # the maxima ignore them
    residual = np.full(master.size, 1e-3, np.float32)
    codes, stats, res = export_codes(master, fmt, "ef", scales=with_specials, residual=residual)
    assert stats.nonfinite == 4 and stats.saturated == 0
    assert np.all(res[:4] == 0) and res[4] != 0
    nan_sign = np.signbit(master[0, :2])
    if f.width == 8:  # e4m3fn: NaN and Inf both serve NaN, sign kept
        assert codes[:4].tolist() == [0x7F | 0x80 * nan_sign[0], 0x7F | 0x80 * nan_sign[1], 0x7F, 0xFF]
    else:  # E2M1 has neither: NaN serves +-0, Inf +-6
        assert codes[:4].tolist() == [0x8 * nan_sign[0], 0x8 * nan_sign[1], 0x7, 0xF]
    for rounding in ("rtn", "sr"):
        again, stats, _ = export_codes(master, fmt, rounding, scales=with_specials)
        assert np.array_equal(again[:4], codes[:4]) and stats.nonfinite == 4


@pytest.mark.parametrize("fmt", MICRO)
@pytest.mark.parametrize("rounding", ["sr", "ef"])
def test_same_bits_for_any_chunking(fmt: str, rounding: str) -> None:
    f = FORMATS[fmt]
    gen = np.random.default_rng(6)
    master = gen.normal(0, 0.02, (12, 6 * f.block)).astype(np.float32)
    residual = gen.normal(0, 1e-4, master.size).astype(np.float32)
    scales = block_scales(master + residual.reshape(master.shape), f)
    whole, _, whole_res = export_codes(master, fmt, rounding, scales=scales, residual=residual)
    flat = master.reshape(-1)
    for piece in (f.block, 3 * f.block, 10, f.block * 6 * 5):
        parts, res_parts = [], []
        for o in range(0, flat.size, piece):
            codes, _, res = export_codes(flat[o : o + piece], fmt, rounding, offset=o, scales=scales,
                                         residual=residual[o : o + piece])
            parts.append(codes)
            res_parts.append(res)
        assert np.array_equal(whole, np.concatenate(parts))
        if rounding == "ef":
            assert np.array_equal(whole_res.view(np.uint32), np.concatenate(res_parts).view(np.uint32))


def test_packed_chunks_must_start_and_end_on_a_byte() -> None:
    f = FORMATS["mxfp4"]
    master = np.zeros((1, 32), np.float32)
    scales = block_scales(master, f)
    spec = ExportSpec("mxfp4", "rtn")
    with pytest.raises(ValueError, match="must be even"):
        export_array(master.reshape(-1)[1:], np.empty(15, np.uint8), spec, version=1, name="w", fmt=f, offset=1,
                     scales=scales)
    with pytest.raises(ValueError, match="bytes"):
        export_array(master.reshape(-1), np.empty(32, np.uint8), spec, version=1, name="w", fmt=f, scales=scales)
    with pytest.raises(ValueError, match="its own scales"):
        export_array(master.reshape(-1), np.empty(16, np.uint8), spec, version=1, name="w", fmt=f,
                     scales=fp8_scales(master, FORMATS["fp8_e4m3"], "tensor"))


def test_packing_order() -> None:
    codes = np.array([0x1, 0x2, 0x3, 0xF, 0x0, 0x8], np.uint8)
    packed = pack(codes)
    assert packed.tolist() == [0x21, 0xF3, 0x80]  # element 2i in the low nibble
    assert np.array_equal(unpack(packed), codes)
    assert pack(torch.from_numpy(codes)).tolist() == packed.tolist()
    # ml_dtypes reads the low nibble of each code: element 0 of [1.0, -6.0] is 1.0
    master = np.zeros((1, 32), np.float32)
    master[0, :2] = [1.0, -6.0]
    out = export_state_dict({"x.weight": torch.from_numpy(master)}, ExportSpec("mxfp4", "rtn"), version=1)
    byte = int(out["x.weight_packed"][0, 0])
    assert np.array([byte & 0xF, byte >> 4], np.uint8).view(ml_dtypes.float4_e2m1fn).astype(float).tolist() == [
        1.0, -6.0]


@pytest.mark.parametrize("fmt", MICRO)
def test_served_tensors_and_dequantize_round_trip(fmt: str) -> None:
    f = FORMATS[fmt]
    gen = np.random.default_rng(8)
    n, k = 6, 4 * f.block
    # Values that are exactly element value x block scale: rtn serves them unchanged.
    codes = gen.integers(0, 1 << f.width, (n, k)).astype(np.uint8)
    if f.width == 8:
        codes[(codes & 0x7F) == 0x7F] = 0x01  # no NaN
    values = codes.view(ELEMENT_DTYPE[fmt]).astype(np.float32) if f.width == 8 else (
        codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    values[:, :: f.block] = f.max_value  # pins each block's scale to a power of two (gs 1 below)
    master = values * np.ldexp(np.float32(1), gen.integers(-6, 8, (n, 1))).astype(np.float32)
    if f.global_scale:  # gs = 1: the block scales are the powers of two themselves
        master[0, : f.block] = 0
        master[0, 0] = 448 * 6
    spec = ExportSpec(fmt, "rtn")
    out = export_state_dict({"x.weight": torch.from_numpy(master), "x.norm.weight": torch.ones(k)}, spec, version=1)
    layout = served_tensors("x.weight", (n, k), f)
    assert [(name, tuple(out[name].shape)) for name, _, _ in layout] == [(name, shape) for name, shape, _ in layout]
    assert set(out) == {name for name, _, _ in layout} | {"x.norm.weight"}
    assert out["x.norm.weight"].dtype == torch.bfloat16
    assert out[layout[0][0]].dtype == (torch.float8_e4m3fn if fmt == "mxfp8" else torch.uint8)
    # compressed-tensors' names, which vLLM loads
    assert [name for name, _, _ in layout] == {"mxfp8": ["x.weight", "x.weight_scale"],
                                               "mxfp4": ["x.weight_packed", "x.weight_scale"],
                                               "nvfp4": ["x.weight_packed", "x.weight_scale",
                                                         "x.weight_global_scale"]}[fmt]
    back = dequantize(out, "x.weight", f, (n, k))
    assert back.dtype == np.float32 and np.array_equal(back, master)
    # The same from the served bytes as the service holds them.
    raw = {name: out[name].contiguous().view(torch.uint8).numpy().reshape(-1) for name, _, _ in layout}
    assert np.array_equal(dequantize(raw, "x.weight", f, (n, k)), master)


def test_format_selection() -> None:
    spec = ExportSpec("nvfp4", "sr")
    assert spec.format_for("a.weight", (8, 48)).name == "nvfp4"
    assert spec.format_for("a.weight", (8, 40)).name == "bf16"  # rows not a multiple of 16
    assert spec.format_for("embed.weight", (8, 48)).name == "bf16"
    assert spec.format_for("a.weight", (48,)).name == "bf16"
    assert ExportSpec("mxfp4").format_for("a.weight", (8, 48)).name == "bf16"  # not a multiple of 32
    assert ExportSpec("mxfp8").format_for("a.weight", (8, 64)).name == "mxfp8"
    assert ExportSpec("fp8_e4m3").format_for("a.weight", (8, 40)).name == "fp8_e4m3"  # unchanged


def special_masters(fmt: str, rows: int = 16, blocks: int = 8) -> np.ndarray:
    """Normal values with NaN, +-Inf, +-0, fp32 subnormals, a zero block, huge and tiny blocks."""
    f = FORMATS[fmt]
    gen = np.random.default_rng(9)
    master = gen.normal(0, 0.02, (rows, blocks * f.block)).astype(np.float32)
    flat = master.reshape(-1)
    flat[gen.integers(0, flat.size, 40)] = gen.choice(np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40,
                                                                -1e-45, 3.4e38, 448.0, 6.0, -5.0], np.float32), 40)
    master[1, : f.block] = 0
    with np.errstate(over="ignore"):  # a huge block, where some values overflow to Inf
        master[2, f.block : 2 * f.block] *= np.float32(1e38)
    master[3, : f.block] *= np.float32(1e-38)
    return master


@pytest.mark.parametrize("fmt", MICRO)
def test_torch_scales_are_the_numpy_scales(fmt: str) -> None:
    f = FORMATS[fmt]
    master = special_masters(fmt)
    ours, theirs = block_scales(master, f), block_scales_torch(torch.from_numpy(master), f)
    assert ours.codes is not None and theirs.codes is not None
    for a, b in [(ours.codes, theirs.codes), (ours.scale_inv, theirs.scale_inv)]:
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert (ours.global_scale is None) == (theirs.global_scale is None) and (
        ours.global_scale is None or np.array_equal(ours.global_scale, theirs.global_scale))


@pytest.mark.parametrize("fmt", MICRO)
@pytest.mark.parametrize("rounding", ["rtn", "sr", "sr-sticky", "ef"])
def test_triton_is_bit_identical_to_the_cpu_kernel(fmt: str, rounding: str) -> None:
    pytest.importorskip("weightsvc.rounding._triton", reason="needs triton (the dev extra, Linux x86_64)")
    from weightsvc.rounding import export_tensor
    from weightsvc.service.device import Exporter

    f = FORMATS[fmt]
    spec = ExportSpec(fmt, rounding, seed=3)
    master = special_masters(fmt)
    ef = rounding == "ef"
    residual = np.random.default_rng(2).normal(0, 1e-3, master.size).astype(np.float32)
    values = master + residual.reshape(master.shape) if ef else master
    scales = block_scales(values, f)
    flat = master.reshape(-1)
    cpu = np.empty(f.nbytes(flat.size), np.uint8)
    cpu_res = np.empty_like(residual)
    stats = export_array(flat, cpu, spec, version=4, name="x.weight", fmt=f, scales=scales, residual=residual,
                         new_residual=cpu_res)
    assert stats.nonfinite > 0
    # The whole tensor, as `export` runs it on CUDA (the interpreter runs it on CPU tensors here).
    shape = served_tensors("x.weight", master.shape, f)[0][1]
    out = torch.empty(shape, dtype=torch.float8_e4m3fn if f.width == 8 else torch.uint8)
    gpu_res = torch.empty(flat.size, dtype=torch.float32)
    export_tensor(torch.from_numpy(flat), out.view(torch.uint8).reshape(-1), spec, f, version=4, name="x.weight",
                  scales=scales, residual=torch.from_numpy(residual) if ef else None,
                  new_residual=gpu_res if ef else None)
    assert np.array_equal(out.view(torch.uint8).numpy().reshape(-1), cpu)
    if ef:
        assert np.array_equal(gpu_res.numpy().view(np.uint32), cpu_res.view(np.uint32))
    # In chunks, through the service's device kernels (FP4 packed on the device).
    kernels = Exporter("cuda-interpreted", "cpu")
    chunked = np.empty_like(cpu)
    chunked_res = np.empty_like(residual)
    piece = 6 * f.block + 2  # not a multiple of the block: the scale index is the element's own
    for o in range(0, flat.size, piece):
        end = min(o + piece, flat.size)
        kernels.export_array(flat[o:end], chunked[f.nbytes(o) : f.nbytes(end)], spec, version=4, name="x.weight",
                             fmt=f, offset=o, scales=scales, residual=residual[o:end],
                             new_residual=chunked_res[o:end])
    assert np.array_equal(chunked, cpu)
    if ef:
        assert np.array_equal(chunked_res.view(np.uint32), cpu_res.view(np.uint32))


@pytest.mark.parametrize("scaling", ["tensor", "channel", "block"])
def test_dequantize_reads_the_other_formats_too(scaling: str) -> None:
    master = torch.from_numpy(np.random.default_rng(10).normal(0, 0.02, (130, 200)).astype(np.float32))
    out = export_state_dict({"x.weight": master, "b": master[0]}, ExportSpec("fp8_e4m3", "sr", scaling=scaling),
                            version=1)
    scale = out["x.weight_scale_inv"].numpy()
    if scaling == "block":
        scale = np.kron(scale, np.ones((128, 128), np.float32))[:130, :200]
    expected = out["x.weight"].float().numpy() * scale
    assert np.array_equal(dequantize(out, "x.weight", FORMATS["fp8_e4m3"], (130, 200), scaling), expected)
    assert np.array_equal(dequantize(out, "b", FORMATS["bf16"], (200,)), out["b"].float().numpy())
