"""Update visibility on the real exports: steps far below an ulp never read invisible under the
unbiased roundings, round to nearest's frozen copy reads 0, big steps read 1 in every mode, and the
standard error the estimate is gated on is the spread of the ratio."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from weightsvc.protocol.lag import (
    SAMPLE_TARGET,
    VISIBILITY_MAX_SE,
    VISIBILITY_MIN_ELEMENTS,
    LagTracker,
    Sample,
    visibility_estimate,
)
from weightsvc.rounding import FORMATS, ExportSpec, Residual, decode, export_state_dict, fair_cast

# The alert's threshold (deploy/prometheus/weightsvc-alerts.yml, WeightsvcUpdatesInvisible).
INVISIBLE_BELOW = 0.5


def masters(versions: int, relative_step: float, *, bf16_start: bool, walk: bool = False,
            elements: int = SAMPLE_TARGET, seed: int = 0) -> list[torch.Tensor]:
    """fp32 masters of weights ~0.02 that move by `relative_step` of their value each version: in a
    direction fixed per element (a drift, as Adam's momentum makes it), or drawn anew (a random
    walk). A bf16 start is a checkpoint being fine-tuned; otherwise the masters are off the bf16 grid,
    as in any run after its first steps. SAMPLE_TARGET elements: the largest model measured exactly,
    and the sample of every larger one."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(elements, generator=gen, dtype=torch.float64) * 0.02
    if bf16_start:
        m = m.to(torch.bfloat16).double()
    direction = torch.randn(elements, generator=gen, dtype=torch.float64).sign()
    out = []
    for _ in range(versions):
        out.append(m.float())
        if walk:
            direction = torch.randn(elements, generator=gen, dtype=torch.float64).sign()
        m = m + relative_step * m.abs() * direction
    return out


def served(master: torch.Tensor, rounding: str, version: int, residual: Residual) -> np.ndarray:
    """The bf16 bits the service serves for `master` at `version` (the learner's own export)."""
    if rounding == "ef":
        out = export_state_dict({"w": master}, ExportSpec("bf16", "ef"), version=version, residual=residual)["w"]
    else:
        out = fair_cast(master, rounding=rounding, version=version, name="w")
    return out.view(torch.int16).numpy().view(np.uint16)


def visibilities(versions: list[torch.Tensor], rounding: str) -> list[float | None]:
    """update_visibility of every version after the first, as the service computes it."""
    tracker, residual, out = LagTracker(), Residual(), []
    for version, master in enumerate(versions, start=1):
        bits = served(master, rounding, version, residual)
        sample = Sample(master.numpy(), decode(bits, FORMATS["bf16"]), bits.astype(np.uint32))
        out.append(tracker.observe(version, sample, 0, True).update_visibility)
    return out[1:]


@pytest.mark.parametrize(
    ("rounding", "bf16_start", "walk", "elements", "seed"),
    [
        ("sr", False, False, SAMPLE_TARGET, 0),
        ("sr-sticky", False, False, SAMPLE_TARGET, 0),
        ("ef", False, False, SAMPLE_TARGET, 0),
        ("sr", True, False, SAMPLE_TARGET, 0),
        ("sr-sticky", True, False, SAMPLE_TARGET, 0),
        ("sr", False, True, SAMPLE_TARGET, 0),
        ("ef", False, True, SAMPLE_TARGET, 0),
        # A draw in which the few elements flipped early carry all of the errors: they must not pass
        # for a precise figure (without VISIBILITY_MIN_ELEMENTS this one reads 0.28).
        ("sr", True, True, SAMPLE_TARGET // 4, 1),
    ],
)
def test_tiny_steps_under_unbiased_rounding_never_read_invisible(
    rounding: str, bf16_start: bool, walk: bool, elements: int, seed: int
) -> None:
    """200 versions of steps of 1e-6 of the value (a few thousandths of a bf16 ulp): a single
    step's ratio is rounding noise (standard error ~6 on this sample), so the figure is told only
    over a window long enough, within five standard errors of 1: never below the alert's threshold.
    A steady drift is told well within the 200 versions."""
    seen = visibilities(masters(200, 1e-6, bf16_start=bf16_start, walk=walk, elements=elements, seed=seed), rounding)
    told = [v for v in seen if v is not None]
    assert all(abs(v - 1) <= 5 * VISIBILITY_MAX_SE for v in told), (min(told), max(told))
    assert all(v >= INVISIBLE_BELOW for v in told)
    if not walk and elements == SAMPLE_TARGET:
        assert None not in seen[-50:], seen[-50:]


@pytest.mark.parametrize("walk", [False, True])
def test_tiny_steps_under_round_to_nearest_read_zero(walk: bool) -> None:
    """From a bf16 checkpoint, round to nearest serves the checkpoint itself while the masters stay
    within half an ulp of it: none of the update reached the served copy, and that is told at every
    version (the alert keeps firing)."""
    assert visibilities(masters(200, 1e-6, bf16_start=True, walk=walk), "rtn") == [0.0] * 199


@pytest.mark.parametrize("rounding", ["rtn", "sr", "sr-sticky", "ef"])
@pytest.mark.parametrize("bf16_start", [False, True])
def test_big_steps_read_one_in_every_mode(rounding: str, bf16_start: bool) -> None:
    """Steps of 1% of the value (a few ulps): every version's own step tells it, near 1."""
    seen = visibilities(masters(20, 1e-2, bf16_start=bf16_start, elements=SAMPLE_TARGET // 16), rounding)
    assert all(v is not None and abs(v - 1) < 0.05 for v in seen), seen


def test_ef_from_a_bf16_start_reads_zero_until_its_residual_moves_the_served_copy() -> None:
    """ef serves round to nearest's bits, bit for bit, until a residual reaches half an ulp: about
    sqrt(ulp / step) versions (60-90 for steps of 1e-6 in bf16). Nothing reached the served copy
    until then: it reads 0, like rtn (an alert sees it only for as long)."""
    versions = masters(100, 1e-6, bf16_start=True)
    residual, first, moved = Residual(), served(versions[0], "rtn", 1, Residual()), 0
    for version, master in enumerate(versions, start=1):
        if not np.array_equal(served(master, "ef", version, residual), first):
            moved = version
            break
    assert 40 <= moved <= 100, moved
    assert visibilities(versions[: moved - 1], "ef") == [0.0] * (moved - 2)


def test_the_standard_error_is_the_spread_of_the_ratio() -> None:
    """One step of stochastic rounding, exported under 400 keys (independent roundings): the ratio
    minus 1 over its standard error has mean 0 and variance 1, within four standard errors of each
    for 400 draws (the variance of a normal sample's variance is 2 / (R - 1))."""
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(4096, generator=gen) * 0.02
    end = start + 1e-6 * torch.randn(4096, generator=gen).sign()  # about a hundredth of an ulp
    draws = 400
    z = []
    for key in range(draws):
        ends = [
            decode(fair_cast(m, rounding="sr", version=v, name="w").view(torch.int16).numpy().view(np.uint16),
                   FORMATS["bf16"]).astype(np.float64)
            for m, v in ((start, 2 * key + 1), (end, 2 * key + 2))
        ]
        estimate = visibility_estimate(end.double().numpy(), ends[1], start.double().numpy(), ends[0])
        assert estimate is not None and math.isfinite(estimate[1])
        z.append((estimate[0] - 1) / estimate[1])
    assert abs(np.mean(z)) < 4 / math.sqrt(draws)
    assert abs(np.var(z, ddof=1) - 1) < 4 * math.sqrt(2 / (draws - 1))


def test_errors_on_few_elements_do_not_pass_for_precision() -> None:
    """The served copy equals the masters but on 5 elements: the noise estimate rests on 5 values,
    not on the thousand the master moved, so it is not taken as precise; with none, the ratio is exact."""
    start = np.linspace(0.01, 0.02, 1000)
    end = start + 1e-5
    off = np.zeros(1000)
    off[:5] = 1e-3
    few = visibility_estimate(end, end + off, start, start)
    assert few is not None and few[1] == math.inf
    assert visibility_estimate(end, end, start, start) == (1.0, 0.0)
    spread = visibility_estimate(end, end + np.resize([1e-5, -1e-5], 1000), start, start)
    assert spread is not None and 0 < spread[1] < VISIBILITY_MAX_SE
    assert VISIBILITY_MIN_ELEMENTS > 5
