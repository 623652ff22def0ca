"""Fair Cast bf16 export: rtn against torch's cast, sr against exact bit arithmetic, keys, specials."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsvc.rounding import ExportSpec, export_array, export_runs, fair_cast

BF16_MAX_BITS = 0x7F7F


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def from_bits32(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32).copy())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=512))
def test_rtn_is_torch_cast_with_saturation(patterns: list[int]) -> None:
    master = from_bits32(np.array(patterns, dtype=np.uint64))
    ours = fair_cast(master, rounding="rtn", version=1, name="w")
    ref = master.to(torch.bfloat16)
    finite_in = torch.isfinite(master)
    overflow = finite_in & ~torch.isfinite(ref)
    same = finite_in & ~overflow
    assert np.array_equal(bits16(ours)[same.numpy()], bits16(ref)[same.numpy()])
    # Finite values beyond the range saturate to +-max instead of becoming Inf.
    sat = bits16(ours)[overflow.numpy()]
    assert np.all((sat & 0x7FFF) == BF16_MAX_BITS)
    assert torch.equal(torch.isnan(ours), torch.isnan(master))
    inf = torch.isinf(master)
    assert torch.equal(ours[inf].float(), master[inf])


@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_special_values(rounding: str) -> None:
    master = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40, 3.4e38, -3.4e38])
    out = torch.empty(master.shape, dtype=torch.bfloat16)
    stats = export_array(
        master.numpy(), out.view(torch.uint8).numpy(), ExportSpec("bf16", rounding, 0), version=1, name="specials"
    )
    b = bits16(out)
    assert b[0] == 0x0000 and b[1] == 0x8000  # signed zeros kept
    assert b[2] == 0x7F80 and b[3] == 0xFF80  # infinities kept
    assert torch.isnan(out[4])
    assert torch.isfinite(out[5:]).all()  # subnormals and near-max stay finite
    assert (b[7] & 0x7FFF) <= BF16_MAX_BITS and (b[8] & 0x7FFF) <= BF16_MAX_BITS
    assert stats.nonfinite == 3


def test_sr_picks_a_neighbour_with_the_right_frequency() -> None:
    # x lies a fraction p of the way from its lower bf16 neighbour to the upper one.
    lower = torch.tensor(0.0234375, dtype=torch.bfloat16)
    ulp = 2.0 ** (math.floor(math.log2(lower.item())) - 7)
    for p in (0.1, 0.5, 0.9):
        n = 40_000
        master = torch.full((n,), lower.item() + p * ulp, dtype=torch.float32)
        served = fair_cast(master, rounding="sr", version=7, name=f"p{p}").float()
        up = served > lower.float()
        assert torch.all((served == lower.float()) | (served == lower.float() + ulp))
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(up.float().mean().item() - p) < 5 * sigma


def test_sr_mean_error_is_within_the_sampling_bound() -> None:
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(200_000, generator=gen) * 0.02
    served = fair_cast(master, rounding="sr", version=3, name="w").double()
    err = served - master.double()
    # Each error is bounded by one ulp of its element; the mean of n independent zero-mean errors
    # has standard deviation at most sqrt(mean(ulp^2) / n).
    ulp = torch.ldexp(torch.ones_like(master.double()), torch.frexp(master.double()).exponent - 8)
    bound = 5 * math.sqrt((ulp**2).mean().item() / len(master))
    assert abs(err.mean().item()) < bound


def test_same_bits_for_any_chunking() -> None:
    master = torch.randn(10_001) * 0.02
    whole = fair_cast(master, rounding="sr", seed=5, version=9, name="layer.weight")
    pieces = []
    for start in range(0, master.numel(), 1234):
        piece = master[start : start + 1234]
        pieces.append(fair_cast(piece, rounding="sr", seed=5, version=9, name="layer.weight", offset=start))
    assert np.array_equal(bits16(whole), bits16(torch.cat(pieces)))


@pytest.mark.parametrize("rounding", ["rtn", "sr", "sr-sticky"])
def test_many_runs_in_one_call_give_the_bits_of_one_call_each(rounding: str) -> None:
    """The service exports small tensors together: same bits and counts as one export each, with
    specials, saturation, empty runs and element offsets past 2**32."""
    rng = np.random.default_rng(3)
    spec = ExportSpec("bf16", rounding, seed=11)
    sizes = [int(n) for n in rng.integers(0, 200, 300)] + [0, 1]
    masters = [(rng.standard_normal(n) * 1e3).astype(np.float32) for n in sizes]
    masters[5][:4] = [np.inf, np.nan, 3.4e38, -3.39e38]
    names = [f"layers.{i}.weight" for i in range(len(sizes))]
    offsets = [int(o) for o in rng.integers(0, 1 << 40, len(sizes))]
    outs = np.cumsum([0] + [n + 3 for n in sizes])[:-1].tolist()  # gaps between runs stay untouched
    served = np.full(outs[-1] + sizes[-1] + 3, 0xABCD, np.uint16)
    starts = np.cumsum([0, *sizes])
    outs = np.array(outs)
    stats = export_runs(np.concatenate(masters), starts, served, spec, version=4, names=names, offsets=offsets,
                        outs=outs)
    for master, name, offset, out, got in zip(masters, names, offsets, outs, stats, strict=True):
        alone = np.empty(master.size * 2, np.uint8)
        want = export_array(master, alone, spec, version=4, name=name, offset=offset)
        assert np.array_equal(served[out : out + master.size], alone.view(np.uint16)), name
        assert (got.nonfinite, got.saturated) == (want.nonfinite, want.saturated), name
        assert (served[out + master.size : out + master.size + 3] == 0xABCD).all(), name
    assert stats[5].nonfinite == 2
    with pytest.raises(ValueError, match="bf16 with rtn, sr or sr-sticky, not bf16 ef"):
        export_runs(np.concatenate(masters), starts, served, ExportSpec("bf16", "ef"), version=4, names=names,
                    offsets=offsets, outs=outs)


def test_keys_change_the_bits_and_nothing_else_does() -> None:
    master = torch.randn(4096) * 0.02
    base = bits16(fair_cast(master, rounding="sr", seed=1, version=2, name="w"))
    torch.manual_seed(123)  # the global generator is never used
    assert np.array_equal(base, bits16(fair_cast(master, rounding="sr", seed=1, version=2, name="w")))
    for other in (
        dict(seed=2, version=2, name="w"),
        dict(seed=1, version=3, name="w"),
        dict(seed=1, version=2, name="v"),
    ):
        assert not np.array_equal(base, bits16(fair_cast(master, rounding="sr", **other)))


def test_bad_spec_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown rounding 'nearest'"):
        ExportSpec("bf16", "nearest")
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        ExportSpec("int4", "sr")
    with pytest.raises(TypeError, match="'w': master must be float32"):
        fair_cast(torch.zeros(3, dtype=torch.float64), version=1, name="w")
