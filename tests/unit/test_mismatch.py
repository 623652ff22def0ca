"""The trainer-rollout mismatch per weight version: hand-checked values, the mask, several versions
in one batch, an independent per-token oracle (plain `math`), token-weighted combining, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from weightsvc.client import RolloutMismatch, rollout_mismatch
from weightsvc.protocol.mismatch import combine


def k3(log_r: float) -> float:
    return math.exp(log_r) - 1 - log_r


def test_hand_checked_two_versions_with_padding() -> None:
    learner = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    engine = torch.tensor([[-1.0, -1.0, -0.5], [-2.0, -1.0, -0.1]])
    versions = torch.tensor([[3, 3, 4], [4, 4, 4]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last token is padding: its huge delta must not count
    got = rollout_mismatch(learner, engine, versions, mask=mask)
    assert set(got) == {3, 4}
    # version 3: log r = 0, -1
    assert got[3].tokens == 2
    assert got[3].mean_abs_logp_delta == pytest.approx(0.5, rel=1e-15)
    assert got[3].k3_kl == pytest.approx(math.exp(-1) / 2, rel=1e-15)
    assert got[3].outside_band == 0.5  # r = e^-1 < 0.5
    # version 4: log r = 0, 1, 0
    assert got[4].tokens == 3
    assert got[4].mean_abs_logp_delta == pytest.approx(1 / 3, rel=1e-15)
    assert got[4].k3_kl == pytest.approx((math.e - 2) / 3, rel=1e-15)
    assert got[4].outside_band == pytest.approx(1 / 3, rel=1e-15)  # r = e > 2


def test_equal_logprobs_are_no_mismatch() -> None:
    lp = torch.log(torch.rand(64, generator=torch.Generator().manual_seed(1)))
    got = rollout_mismatch(lp, lp.clone(), torch.full((64,), 7))
    assert got == {7: RolloutMismatch(64, 0.0, 0.0, 0.0)}


def test_band_edges_and_custom_band() -> None:
    # r exactly 0.5 and 2 are inside [low, high]; just beyond, outside
    log_r = torch.tensor([math.log(0.5), math.log(2.0), math.log(0.49), math.log(2.01)], dtype=torch.float64)
    zero = torch.zeros(4, dtype=torch.float64)
    assert rollout_mismatch(log_r, zero, torch.zeros(4, dtype=torch.int64))[0].outside_band == 0.5
    assert rollout_mismatch(log_r, zero, torch.zeros(4, dtype=torch.int64), band=(0.4, 5.0))[0].outside_band == 0.0


def test_matches_a_per_token_oracle_on_random_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    engine = torch.log(torch.rand(8, 50, generator=gen)).clamp_min(-20)
    learner = engine + 0.3 * torch.randn(8, 50, generator=gen)
    versions = torch.randint(10, 14, (8, 50), generator=gen)
    mask = torch.rand(8, 50, generator=gen) > 0.2
    got = rollout_mismatch(learner, engine, versions, mask=mask)
    expected: dict[int, list[float]] = {}
    for lv, ev, v, keep in zip(learner.flatten().tolist(), engine.flatten().tolist(), versions.flatten().tolist(),
                               mask.flatten().tolist(), strict=True):
        if keep:
            expected.setdefault(v, []).append(lv - ev)
    assert set(got) == set(expected)
    for v, deltas in expected.items():
        m = got[v]
        assert m.tokens == len(deltas)
        assert m.mean_abs_logp_delta == pytest.approx(sum(map(abs, deltas)) / len(deltas), rel=1e-9)
        assert m.k3_kl == pytest.approx(sum(map(k3, deltas)) / len(deltas), rel=1e-9)
        outside = sum(1 for d in deltas if not 0.5 <= math.exp(d) <= 2.0)
        assert m.outside_band == pytest.approx(outside / len(deltas), rel=1e-12)


def test_split_batches_combine_to_the_whole() -> None:
    gen = torch.Generator().manual_seed(2)
    engine = torch.log(torch.rand(6, 40, generator=gen))
    learner = engine + 0.1 * torch.randn(6, 40, generator=gen)
    versions = torch.randint(0, 3, (6, 40), generator=gen)
    whole = rollout_mismatch(learner, engine, versions)
    parts = combine(rollout_mismatch(learner[:2], engine[:2], versions[:2]),
                    rollout_mismatch(learner[2:], engine[2:], versions[2:]))
    assert set(parts) == set(whole)
    for v in whole:
        assert parts[v].tokens == whole[v].tokens
        for field in ("mean_abs_logp_delta", "k3_kl", "outside_band"):
            assert getattr(parts[v], field) == pytest.approx(getattr(whole[v], field), rel=1e-12)


def test_combined_is_token_weighted() -> None:
    a = RolloutMismatch(1, 1.0, 0.4, 1.0)
    b = RolloutMismatch(3, 0.0, 0.0, 0.0)
    assert a + b == RolloutMismatch(4, 0.25, 0.1, 0.25)


def test_numpy_numbers_are_numbers() -> None:
    np = pytest.importorskip("numpy")
    m = RolloutMismatch(np.int64(3), np.float32(0.5), np.float64(0.25), 0)  # type: ignore[arg-type]
    assert m == RolloutMismatch(3, 0.5, 0.25, 0.0) and type(m.tokens) is int and type(m.k3_kl) is float


def test_masked_out_version_and_empty_batch_are_absent() -> None:
    lp = torch.zeros(4)
    assert rollout_mismatch(lp, lp, torch.tensor([1, 1, 2, 2]), mask=torch.tensor([1, 1, 0, 0])).keys() == {1}
    assert rollout_mismatch(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.int64)) == {}


NAN, NEG_INF = float("nan"), float("-inf")


@pytest.mark.parametrize(("learner", "engine", "versions", "kw", "words"), [
    (torch.zeros(3), torch.zeros(4), torch.zeros(3, dtype=torch.int64), {}, "same shape"),
    (torch.zeros(2, 2, 2), torch.zeros(2, 2, 2), torch.zeros(2, 2, 2, dtype=torch.int64), {}, "3-D"),
    (torch.zeros(3), torch.zeros(3), torch.zeros(3), {}, "integer tensor"),
    (torch.tensor([0.0, NAN]), torch.zeros(2), torch.zeros(2, dtype=torch.int64), {}, "learner_logprobs has 1"),
    (torch.zeros(2), torch.tensor([NEG_INF, 0]), torch.zeros(2, dtype=torch.int64), {}, "engine_logprobs has 1"),
    (torch.zeros(2), torch.zeros(2), torch.tensor([-1, 0]), {}, "versions must be >= 0"),
    (torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.int64), {"mask": torch.ones(3)}, "mask [3]"),
    (torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.int64), {"band": (2.0, 0.5)}, "IcePop band"),
])
def test_bad_input_names_the_problem(learner: torch.Tensor, engine: torch.Tensor, versions: torch.Tensor,
                                     kw: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        rollout_mismatch(learner, engine, versions, **kw)  # type: ignore[arg-type]


def test_non_finite_padding_is_ignored() -> None:
    learner = torch.tensor([-1.0, float("nan")])
    got = rollout_mismatch(learner, torch.tensor([-1.0, 0.0]), torch.tensor([5, -1]), mask=torch.tensor([True, False]))
    assert got == {5: RolloutMismatch(1, 0.0, 0.0, 0.0)}


@pytest.mark.parametrize(("args", "field"), [
    ((0, 0.1, 0.1, 0.1), "tokens must be > 0"),
    ((2.5, 0.1, 0.1, 0.1), "tokens must be an integer"),
    ((1, float("nan"), 0.1, 0.1), "mean_abs_logp_delta must be finite"),
    ((1, 0.1, float("inf"), 0.1), "k3_kl must be finite"),
    ((1, 0.1, -1e-3, 0.1), "k3_kl must be finite and >= 0"),
    ((1, 0.1, 0.1, 1.5), "outside_band is a share"),
])
def test_a_record_checks_its_values(args: tuple[float, ...], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RolloutMismatch(*args)  # type: ignore[arg-type]
