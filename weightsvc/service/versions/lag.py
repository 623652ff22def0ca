"""Lag metrics of the served copy against the learner's masters.

Computed per committed version on a fixed, deterministic sample of elements: every `stride`-th
flat element of every tensor, with `stride` chosen so that a model contributes about
SAMPLE_TARGET elements. Memory stays constant (the samples of the first version, of the previous
one and of at most four anchors of the visibility windows, and one distance per version); for
models of at most SAMPLE_TARGET elements it is exact.

- churn: share of served elements whose bits differ from the previous version;
- update visibility: the share of the master's update over a window of versions a..t that reached
  the served copy, <s_t - s_a, m_t - m_a> / ||m_t - m_a||^2, over the shortest window that tells it
  (below); None when none does;
- lag in steps: with D_tau = ||m_tau - m_ref|| and S_t = <s_t - s_ref, m_t - m_ref> / D_t,
  lag_t = t - max{tau <= t : D_tau <= S_t} (0 when S_t >= D_t);
- relative error ||s_t - m_t|| / ||m_t||; saturated elements (exact, from the export).

Update visibility and rounding noise. Write the served copy as s = m + e, e its rounding error (at
most an ulp). Then visibility - 1 = <e_t - e_a, m_t - m_a> / ||m_t - m_a||^2 exactly. Stochastic
rounding (and ef's feedback) makes e noise of about 0.4 ulp (rms) that does not grow with the
window, while the master's movement does: for one tiny step (1e-6 of the value in bf16, a few
thousandths of an ulp) the noise term dwarfs the step and the ratio of a single step reads anything
(-5.77 was seen; its standard error there is about 6). Over a window of W such steps the signal
grows W-fold (a steady drift) or sqrt(W)-fold (a random walk) and the noise stays. Its standard
error, were the errors independent and zero-mean (as stochastic rounding makes them),

    se = sqrt(sum_i (e_t,i^2 + e_a,i^2) (m_t,i - m_a,i)^2) / ||m_t - m_a||^2,

is estimated from the errors themselves, which every sample holds; it is zero only where the
served copy equals the master, when the ratio is exactly 1. A window tells the visibility when
se <= VISIBILITY_MAX_SE (0.1: a stochastic rounding cannot read below 0.5 but five standard errors
away) and the errors it comes from are spread over at least VISIBILITY_MIN_ELEMENTS elements (the
effective count (sum w)^2 / sum w^2 of the weights above; with fewer, a few elements that happened
not to flip would pass for precision). The windows, shortest first, are the last step (a = t - 1,
the definition of a single step), then anchors refreshed every 16 and every 256 versions, so
16-31 and 256-511 versions back (the run's first version while the run is younger). The
shortest window that tells is reported: a figure as quick as the precision allows, the last step's
whenever that step alone tells it, and nothing (None; NaN on /metrics, which alerts ignore) while
no window can tell the update from the rounding noise. Clamping would not do: it hides the noise
without telling anything.

Round to nearest is deterministic: tiny steps from a bf16-exact master (a checkpoint being
fine-tuned) leave every served element where it was, so s_t = s_a and e = -(m - s) only as large as
the master's drift: the ratio is exactly 0 and tells (WeightsvcUpdatesInvisible keeps firing). From
masters off the grid round to nearest moves the elements that cross a midpoint and reads about 1 on
average (its lag, not its rate, is what it loses). ef from a bf16-exact start is bit for bit round to
nearest until its residual reaches half an ulp, about sqrt(ulp / step) versions (60-90 for steps
of 1e-6 in bf16): it reads 0 until then. The figure is what the served copy did within its window:
where every element steps alike, ef then catches up in bursts of whole ulps that read far from 1,
either way, before it settles about 1.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from weightsvc.protocol.lag import LagMetrics

SAMPLE_TARGET = 1 << 18
VISIBILITY_WINDOWS = (1, 16, 256)  # anchor refresh periods in versions, shortest window first
VISIBILITY_MAX_SE = 0.1
VISIBILITY_MIN_ELEMENTS = 100.0
_NO_BITS = np.zeros(0, np.uint32)


def sample_stride(total_elements: int) -> int:
    return max(1, math.ceil(total_elements / SAMPLE_TARGET))


def sampled_indices(first: int, count: int, stride: int) -> np.ndarray:
    """Indices, relative to `first`, of the sampled flat elements in [first, first + count)."""
    start = -first % stride
    return np.arange(start, count, stride, dtype=np.int64)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """A dot product whose result depends on the values alone: numpy's pairwise sum, unlike BLAS,
    does not change with the arrays' memory alignment (the same version gives the same metrics)."""
    return float(np.sum(a * b))


@dataclass
class Sample:
    """Sampled master values, served values (dequantized) and served bits of one version."""

    master: np.ndarray  # float32
    served: np.ndarray  # float32
    bits: np.ndarray  # uint32 (the served encoding)


def visibility_estimate(master: np.ndarray, served: np.ndarray, start_master: np.ndarray,
                        start_served: np.ndarray) -> tuple[float, float] | None:
    """(visibility, its standard error) over the window from `start_*` to `master`, `served`
    (float64); None when the master did not move. The standard error is infinite when the rounding
    errors it is estimated from sit on fewer than VISIBILITY_MIN_ELEMENTS elements."""
    dm = master - start_master
    norm2 = _dot(dm, dm)
    if norm2 == 0:
        return None
    visibility = _dot(served - start_served, dm) / norm2
    err, start_err = served - master, start_served - start_master
    weights = (err * err + start_err * start_err) * (dm * dm)
    total = float(np.sum(weights))
    if total == 0:  # served exactly as the masters: no noise at all
        return visibility, 0.0
    if total * total < VISIBILITY_MIN_ELEMENTS * _dot(weights, weights):
        return visibility, math.inf
    return visibility, math.sqrt(total) / norm2


@dataclass
class LagTracker:
    """Per model: the reference (first version of the run), the previous version, D_tau, and the
    visibility windows' anchors."""

    ref_version: int | None = None
    ref: Sample | None = None
    prev: Sample | None = None
    distances: dict[int, float] = field(default_factory=dict)  # D_tau per committed version
    observed: int = 0  # versions observed since the reference (the reference is 0)
    # Per refresh period K: the samples of the two latest versions whose count is a multiple of K
    # (the older is None until there are two); the window starts at the older.
    anchors: dict[int, tuple[Sample | None, Sample]] = field(default_factory=dict)

    def snapshot(self) -> LagTracker:
        return copy.copy(self) if not self.distances else LagTracker(
            self.ref_version, self.ref, self.prev, dict(self.distances), self.observed, dict(self.anchors)
        )

    def observe(self, version: int, sample: Sample, saturated: int, exact: bool) -> LagMetrics:
        m, s = sample.master.astype(np.float64), sample.served.astype(np.float64)
        if self.ref is None or self.ref.master.shape != sample.master.shape:
            self.ref_version, self.ref, self.prev, self.distances = version, sample, None, {}
            point = Sample(sample.master, sample.served, _NO_BITS)
            self.observed, self.anchors = 0, {k: (None, point) for k in VISIBILITY_WINDOWS}
        else:
            self.observed += 1
        ref_m, ref_s = self.ref.master.astype(np.float64), self.ref.served.astype(np.float64)
        churn, visibility = 0.0, None
        if self.prev is not None:
            churn = float(np.mean(sample.bits != self.prev.bits)) if sample.bits.size else 0.0
            visibility = self._visibility(sample, m, s)
        dm_ref = m - ref_m
        d_t = math.sqrt(_dot(dm_ref, dm_ref))
        self.distances[version] = d_t
        if d_t == 0:
            lag = 0
        else:
            s_t = _dot(s - ref_s, dm_ref) / d_t
            if s_t >= d_t * (1 - 1e-9):  # equal up to the rounding of the two float64 reductions
                lag = 0
            else:
                reached = [tau for tau, d in self.distances.items() if d <= s_t and tau <= version]
                lag = version - (max(reached) if reached else self.ref_version or 0)
        norm_m = math.sqrt(_dot(m, m))
        err = s - m
        rel = math.sqrt(_dot(err, err)) / norm_m if norm_m > 0 else 0.0
        self.prev = sample
        return LagMetrics(churn, visibility, lag, rel, saturated, int(sample.master.size), exact)

    def _visibility(self, sample: Sample, m: np.ndarray, s: np.ndarray) -> float | None:
        """Advance the anchors to this version, then the estimate of the shortest window that tells."""
        point = Sample(sample.master, sample.served, _NO_BITS)  # an anchor keeps no bits
        starts: list[Sample] = []
        for period, (older, newer) in self.anchors.items():
            if self.observed % period == 0:
                older, newer = newer, point
                self.anchors[period] = (older, newer)
            start = older if older is not None else newer  # the run is younger than the period
            if all(start is not other for other in starts):
                starts.append(start)
        for start in starts:
            estimate = visibility_estimate(m, s, start.master.astype(np.float64), start.served.astype(np.float64))
            if estimate is not None and estimate[1] <= VISIBILITY_MAX_SE:
                return estimate[0]
        return None
