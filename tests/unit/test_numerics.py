"""Formats and modes of Fair Cast against independent oracles (torch's cast, ml_dtypes, exact sums)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.exact_rounding import differences, grid, half_even_codes
from weightsvc.rounding import (
    FORMATS,
    ExportSpec,
    Residual,
    Scales,
    _cpu,
    dequantize,
    export_array,
    export_state_dict,
    fair_cast,
    fp8_scales,
)

ML_DTYPES = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
UNIT_SCALE = Scales(np.ones((), np.float32), _cpu.SCALE_TENSOR, 1, 1)


def export_bits(
    master: np.ndarray,
    fmt: str,
    rounding: str = "rtn",
    *,
    version: int = 1,
    name: str = "w",
    offset: int = 0,
    scales: Scales | None = None,
) -> np.ndarray:
    f = FORMATS[fmt]
    out = np.empty(master.size * f.itemsize, np.uint8)
    spec = ExportSpec(fmt, rounding, 0)
    export_array(
        master.astype(np.float32).reshape(-1),
        out,
        spec,
        version=version,
        name=name,
        fmt=f,
        offset=offset,
        scales=scales if f.scaled else None,
    )
    return out.view(np.uint16 if f.width == 16 else np.uint8)


bit_patterns = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=300)


@settings(max_examples=40, deadline=None)
@given(bit_patterns)
def test_fp16_rtn_is_torch_cast_with_saturation(patterns: list[int]) -> None:
    master = np.array(patterns, dtype=np.uint32).view(np.float32)
    ours = export_bits(master, "fp16")
    ref = torch.from_numpy(master.copy()).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    finite = np.isfinite(master)
    overflow = finite & ~np.isfinite(ref.view(np.float16))
    same = finite & ~overflow
    assert np.array_equal(ours[same], ref[same])
    assert np.all((ours[overflow] & 0x7FFF) == 0x7BFF)  # +-65504, never Inf
    assert np.array_equal(np.isnan(ours.view(np.float16)), np.isnan(master))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@settings(max_examples=40, deadline=None)
@given(patterns=bit_patterns)
def test_fp8_rtn_is_ml_dtypes_after_saturation(fmt: str, patterns: list[int]) -> None:
    master = np.array(patterns, dtype=np.uint32).view(np.float32)
    master = master[np.isfinite(master)]
    if master.size == 0:
        return
    limit = np.float32(FORMATS[fmt].max_value)
    clamped = np.clip(master, -limit, limit)
    ours = export_bits(clamped, fmt, scales=UNIT_SCALE)
    ref = clamped.astype(ML_DTYPES[fmt]).view(np.uint8)
    assert np.array_equal(ours, ref), (clamped[ours != ref][:5], ours[ours != ref][:5], ref[ours != ref][:5])


def scaled_ties(fmt: str, scale: np.float32, amax: np.float32) -> np.ndarray:
    """Every value and midpoint of the format (both signs) times `scale`, rounded to fp32, and the
    fp32 numbers beside each, up to amax: exact ties where the products are exact, near ties
    around them."""
    values = np.array([float(v) for v in grid(fmt)])
    quotients = np.concatenate([values, (values[:-1] + values[1:]) / 2])
    exact = (np.concatenate([quotients, -quotients]) * np.float64(scale)).astype(np.float32)
    probes = np.concatenate([exact, np.nextafter(exact, np.float32(np.inf)), np.nextafter(exact, np.float32(-np.inf))])
    return probes[np.abs(probes) <= amax]


# amax 784: e4m3 scale 1.75 (exact ties); the others: scales of 20-odd bits (near ties)
AMAXES = (784.0, 0.0123, 3.1e-5, 2.0)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scaling", ["tensor", "channel", "block"])
def test_fp8_rtn_under_a_scale_is_half_to_even_of_the_exact_quotient(fmt: str, scaling: str) -> None:
    """Each group (the tensor, a row, a 128x128 block) holds one of AMAXES, which sets its scale,
    and every tie and near tie of the format under that scale."""
    f = FORMATS[fmt]
    groups = {"tensor": 1, "channel": len(AMAXES), "block": len(AMAXES)}[scaling]
    rows, cols = {"tensor": (1, 2048), "channel": (len(AMAXES), 2048), "block": (128, 128 * len(AMAXES))}[scaling]
    master = np.zeros((rows, cols), np.float32)
    for j, amax in enumerate(AMAXES[:groups]):
        a = np.float32(amax)
        scale = fp8_scales(np.full((1, 1), a), f, "tensor").scale_inv.reshape(-1)[0]
        group = np.zeros(2048 if scaling != "block" else 128 * 128, np.float32)
        probes = scaled_ties(fmt, scale, a)
        group[0] = a
        group[1 : 1 + probes.size] = probes
        if scaling == "block":
            master[:, 128 * j : 128 * (j + 1)] = group.reshape(128, 128)
        else:
            master[j] = group
    scales = fp8_scales(master, f, scaling)
    served = export_bits(master, fmt, scales=scales).reshape(master.shape)
    scale = np.broadcast_to(scales.scale_inv, master.shape) if scaling != "block" else np.repeat(
        scales.scale_inv, 128, axis=1)
    expected = half_even_codes(master, scale, fmt)
    assert np.array_equal(served, expected), differences(master, served, expected)
    if fmt == "fp8_e4m3":  # 6.5 * 2^-9 (a subnormal midpoint) times 1.75: to the even 6 * 2^-9
        assert scale[0, 0] == 1.75 and served[master == np.float32(6.5 * 2**-9 * 1.75)][0] == 0x06


@pytest.mark.parametrize("scaling", ["tensor", "channel", "block"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_ef_near_the_fp32_max_serves_finite_values(fmt: str, scaling: str) -> None:
    gen = np.random.default_rng(13)
    master = (gen.uniform(-1, 1, (130, 200)) * 3.4e38).astype(np.float32)
    master[0, 0], master[129, 199] = np.finfo(np.float32).max, -np.finfo(np.float32).max
    residual = Residual()
    big = np.abs(master) > 1e37
    for step in range(1, 5):
        out = export_state_dict({"x.weight": torch.from_numpy(master)}, ExportSpec(fmt, "ef", scaling=scaling),
                                version=step, residual=residual)
        back = dequantize(out, "x.weight", FORMATS[fmt], master.shape, scaling)
        assert np.isfinite(back).all() and np.isfinite(residual.tensors["x.weight"]).all()
        assert np.array_equal(np.signbit(back[big]), np.signbit(master[big]))


@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_generic_kernel_agrees_with_the_bf16_kernel(rounding: str) -> None:
    gen = np.random.default_rng(0)
    bits = gen.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32)
    master = bits.view(np.float32)
    fast = export_bits(master, "bf16", rounding)
    bf16 = FORMATS["bf16"]
    generic = np.empty(master.size, np.uint16)
    k0, k1 = ExportSpec("bf16", rounding).key(1, "w")
    _cpu.float_export(master, generic, np.uint32(k0), np.uint32(k1), np.uint64(0), rounding == "sr",
                      bf16.mantissa, bf16.bias, bf16.emin, bf16.max_bits, bf16.nan_bits, bf16.inf_bits, 16,
                      np.ones(1, np.float32), 0, 1, 1,
                      np.zeros(0, np.float32), np.zeros(0, np.float32), False)
    finite = np.isfinite(master)
    assert np.array_equal(fast[finite], generic[finite])


@pytest.mark.parametrize("fmt, value, lower, upper", [
    ("fp16", 1.0 + 0.3 * 2**-10, 1.0, 1.0 + 2**-10),
    ("fp8_e4m3", 1.0 + 0.7 * 2**-3, 1.0, 1.0 + 2**-3),
    ("fp8_e5m2", 2**-15 * 1.25, 2**-15, 2**-15 * 1.5),  # subnormal range of e5m2 (spacing 2**-16)
])
def test_sr_rounds_up_with_the_right_frequency(fmt: str, value: float, lower: float, upper: float) -> None:
    n = 40_000
    master = np.full(n, value, np.float32)
    codes = export_bits(master, fmt, "sr", scales=UNIT_SCALE)
    dtype = np.float16 if fmt == "fp16" else ML_DTYPES[fmt]
    served = codes.view(dtype).astype(np.float64)
    assert set(np.unique(served)) <= {lower, upper}
    p = (value - lower) / (upper - lower)
    assert abs((served == upper).mean() - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_sr_sticky_keeps_its_thresholds_across_versions() -> None:
    master = torch.randn(50_000) * 0.02
    a = fair_cast(master, rounding="sr-sticky", version=1, name="w")
    b = fair_cast(master, rounding="sr-sticky", version=2, name="w")
    c = fair_cast(master, rounding="sr", version=1, name="w")
    d = fair_cast(master, rounding="sr", version=2, name="w")
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    churn_sr = (c.view(torch.int16) != d.view(torch.int16)).float().mean().item()
    assert churn_sr > 0.2  # fresh randomness per version flips about a third of the elements
    # A small step moves few sticky elements: churn close to rtn's.
    moved = master + 1e-6
    e = fair_cast(moved, rounding="sr-sticky", version=3, name="w")
    assert (a.view(torch.int16) != e.view(torch.int16)).float().mean().item() < 0.05
    err = (a.double() - master.double()).mean().item()
    assert abs(err) < 5 * 2**-8 * 0.02 / math.sqrt(master.numel()) * 4  # unbiased across elements


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3"])
def test_ef_running_sum_tracks_the_masters(fmt: str) -> None:
    gen = torch.Generator().manual_seed(0)
    name = "layers.0.weight"
    master = (torch.randn(64, 256, generator=gen) * 0.02).to(torch.bfloat16).float()
    residual = Residual()
    spec = ExportSpec(fmt, "ef", scaling="tensor")
    sum_served = torch.zeros_like(master, dtype=torch.float64)
    sum_master = torch.zeros_like(master, dtype=torch.float64)
    for step in range(1, 41):
        master = master + torch.randn(master.shape, generator=gen) * 1e-5
        out = export_state_dict({name: master}, spec, version=step, residual=residual)
        served = out[name].double()
        if fmt.startswith("fp8"):
            served = served * out[name + "_scale_inv"].double()
        sum_served += served
        sum_master += master.double()
    assert residual.version == 40
    # The difference of the running sums is minus the last residual: at most half a served ulp
    # (plus the fp32 rounding of m + e).
    gap = (sum_master - sum_served).abs()
    assert torch.allclose(gap, torch.from_numpy(residual.tensors[name]).double().abs().reshape(gap.shape),
                          atol=1e-6)
    half_ulp = served.abs().clamp_min(1e-30) * 2.0 ** -(FORMATS[fmt].mantissa + 1)
    assert (gap <= half_ulp * 1.01 + 1e-7).float().mean().item() > 0.99


def test_ef_resets_the_residual_where_the_master_is_not_finite() -> None:
    residual = Residual(tensors={"w": np.full(4, 1e-3, np.float32)})
    master = torch.tensor([1.0, math.nan, math.inf, 2.0])
    export_state_dict({"w": master}, ExportSpec("bf16", "ef"), version=1, residual=residual)
    r = residual.tensors["w"]
    assert r[1] == 0 and r[2] == 0 and r[0] != 0


@pytest.mark.parametrize("scaling, shape", [("tensor", ()), ("channel", (300, 1)), ("block", (3, 2))])
def test_fp8_scales_layout_and_values(scaling: str, shape: tuple[int, ...]) -> None:
    gen = np.random.default_rng(1)
    values = gen.normal(0, 0.02, (300, 200)).astype(np.float32)
    values[128:256, 128:200] = 0  # an all-zero block gets scale 1
    fmt = FORMATS["fp8_e4m3"]
    scales = fp8_scales(values, fmt, scaling)
    assert scales.scale_inv.shape == shape and scales.scale_inv.dtype == np.float32
    if scaling == "block":
        assert scales.scale_inv[1, 1] == 1
        assert scales.scale_inv[0, 0] == np.float32(np.abs(values[:128, :128]).max()) / np.float32(448)
    if scaling == "tensor":
        assert scales.scale_inv == np.float32(np.abs(values).max()) / np.float32(448)
    out = export_state_dict({"x.weight": torch.from_numpy(values)}, ExportSpec("fp8_e4m3", "rtn", scaling=scaling),
                            version=1)
    assert out["x.weight"].dtype == torch.float8_e4m3fn
    scale_inv = out["x.weight_scale_inv"].numpy()
    if scaling == "block":
        full = np.kron(scale_inv, np.ones((128, 128), np.float32))[:300, :200]
    else:
        full = np.broadcast_to(scale_inv, values.shape)
    deq = out["x.weight"].float().numpy() * full
    # Dequantised error within half the e4m3 spacing at each scaled magnitude.
    scaled = np.abs(values) / full
    spacing = np.exp2(np.floor(np.log2(np.maximum(scaled, 2.0**-6))) - 3) * full
    assert np.all(np.abs(deq - values) <= spacing / 2 * 1.0001 + 1e-12)


def test_fp8_goes_to_selected_weights_only() -> None:
    masters = {"embed_tokens.weight": torch.randn(16, 8), "layers.0.mlp.weight": torch.randn(16, 8),
               "layers.0.norm.weight": torch.randn(8), "layers.0.mlp.bias": torch.randn(16)}
    out = export_state_dict(masters, ExportSpec("fp8_e5m2", "sr"), version=1)
    assert {k: v.dtype for k, v in out.items()} == {
        "embed_tokens.weight": torch.bfloat16, "layers.0.mlp.weight": torch.float8_e5m2,
        "layers.0.mlp.weight_scale_inv": torch.float32, "layers.0.norm.weight": torch.bfloat16,
        "layers.0.mlp.bias": torch.bfloat16,
    }


@pytest.mark.parametrize("fmt, rounding", [("fp16", "sr"), ("bf16", "sr-sticky"), ("fp8_e5m2", "sr")])
def test_same_bits_for_any_chunking_and_any_split_across_ranks(fmt: str, rounding: str) -> None:
    master = (np.random.default_rng(2).normal(0, 0.02, 10_007)).astype(np.float32)
    whole = export_bits(master, fmt, rounding, scales=UNIT_SCALE)
    for piece in (1, 1000, 4096):
        parts = [export_bits(master[o : o + piece], fmt, rounding, offset=o, scales=UNIT_SCALE)
                 for o in range(0, master.size, piece)]
        assert np.array_equal(whole, np.concatenate(parts))


@pytest.mark.parametrize(("fmt", "scaling"), [("fp8_e4m3", "block"), ("fp8_e4m3", "channel"), ("nvfp4", "block"),
                                             ("mxfp4", "block")])
@pytest.mark.parametrize("rounding", ["sr", "ef"])
def test_scaled_export_of_many_runs_any_chunking(fmt: str, scaling: str, rounding: str) -> None:
    """The CPU kernel goes run by run of elements that share a scale, in spans of 2**16 elements per
    thread: a tensor of several spans, whole or in chunks that start mid-row and mid-block (so the
    spans and runs fall elsewhere), gives the same bits and residuals."""
    f = FORMATS[fmt]
    gen = np.random.default_rng(4)
    m = gen.normal(0, 0.02, (288, 640)).astype(np.float32)
    m.flat[::997] = np.resize(np.array([np.nan, np.inf, 1e30, -0.0], np.float32), m.flat[::997].size)
    residual = gen.normal(0, 1e-4, m.size).astype(np.float32)
    spec = ExportSpec(fmt, rounding, scaling=scaling, fp8_pattern=".*", seed=9)
    scales = fp8_scales(np.nan_to_num(m, nan=0, posinf=0, neginf=0) + residual.reshape(m.shape), f, scaling)
    flat = m.reshape(-1)

    def export(lo: int, hi: int) -> tuple[bytes, np.ndarray, tuple[int, int]]:
        out = np.empty(f.nbytes(hi - lo), np.uint8)
        new = np.empty(hi - lo, np.float32)
        ef = {"residual": residual[lo:hi], "new_residual": new} if rounding == "ef" else {}
        stats = export_array(flat[lo:hi], out, spec, version=3, name="w", fmt=f, offset=lo, scales=scales, **ef)
        return out.tobytes(), new, (stats.nonfinite, stats.saturated)

    whole, whole_res, whole_stats = export(0, flat.size)
    cuts = [0, 70_000, 140_002, flat.size]  # (even: FP4 chunks start and end on a byte)
    parts = [export(a, b) for a, b in itertools.pairwise(cuts)]
    assert b"".join(p[0] for p in parts) == whole
    assert [sum(p[2][i] for p in parts) for i in (0, 1)] == list(whole_stats) and whole_stats[0] > 0
    if rounding == "ef":
        assert np.array_equal(np.concatenate([p[1] for p in parts]).view(np.uint32), whole_res.view(np.uint32))


def test_residual_save_and_load(tmp_path: Path) -> None:
    r = Residual(7, {"a": np.arange(5, dtype=np.float32), "b": np.zeros(0, np.float32)})
    r.save(tmp_path / "r.safetensors")
    back = Residual.load(tmp_path / "r.safetensors")
    assert back.version == 7 and set(back.tensors) == {"a", "b"}
    assert np.array_equal(back.tensors["a"], r.tensors["a"])
    assert not list(tmp_path.glob(".*tmp"))


def test_sr_far_below_the_smallest_subnormal_is_zero() -> None:
    # 1.5 * 2**-97 is ~2**-73 fp16 ulps: P(up) is below the resolution of the 32 random bits.
    master = np.full(20_000, 1.5 * 2.0**-97, np.float32)
    assert not export_bits(master, "fp16", "sr").any()
    assert not export_bits(master, "fp8_e5m2", "sr", scales=UNIT_SCALE).any()


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_ef_keeps_the_sign_of_zero(fmt: str) -> None:
    out = export_state_dict({"w": torch.tensor([-0.0, 0.0])}, ExportSpec(fmt, "ef"), version=1, residual=Residual())
    assert out["w"].view(torch.int16).tolist() == [-0x8000, 0]


def test_ef_does_not_wind_up_when_saturating() -> None:
    residual = Residual()
    spec = ExportSpec("fp16", "ef")
    for step in range(1, 11):
        export_state_dict({"w": torch.full((4,), 1e5)}, spec, version=step, residual=residual)
    assert not residual.tensors["w"].any()
    out = export_state_dict({"w": torch.zeros(4)}, spec, version=11, residual=residual)
    assert not out["w"].float().any()  # back to the master at once


def test_tiny_fp8_scales_keep_zeros_zero() -> None:
    values = torch.tensor([[1e-37, 0.0, 0.0, 0.0]])
    out = export_state_dict({"x.weight": values}, ExportSpec("fp8_e4m3", "rtn", scaling="block"), version=1)
    assert out["x.weight"].float()[0, 1:].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(out["x.weight_scale_inv"]).all()
