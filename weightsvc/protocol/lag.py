"""Lag metrics of the served copy against the learner's masters: the one rule, for a push (the
service holds masters and served copy) and for a publish (each learner rank measures its rows, the
service combines the ranks' sums: `LagRows`, `LagSums`, `LagHistory`).

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

Across the ranks of a publish. Each figure is a ratio of sums over the sampled elements, or a count:
||m_t - m_ref||^2, <s_t - s_ref, m_t - m_ref>, ||m_t||^2, ||s_t - m_t||^2, the elements whose bits
changed and those compared, and per window <s_t - s_a, m_t - m_a>, ||m_t - m_a||^2, sum w and sum w^2.
A learner rank sums over its rows (`LagRows.observe` -> `LagSums`), the service adds the ranks' sums
(`combine`) and reads the figures from the total as from a push's (`LagHistory.figures`): the same
figures, but for the order the float64 additions ran in. The window that tells is chosen on the
total, never per rank; D_tau of the earlier versions is the service's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LagMetrics:
    churn: float
    update_visibility: float | None
    lag_steps: int
    relative_error: float
    saturated_elements: int
    sampled_elements: int
    exact: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def pool_lag(parts: list[LagMetrics | None]) -> LagMetrics | None:
    """The lag metrics of a version made of parts (sharded replicas), from each part's own: shares
    weighted by sampled elements, lag in steps the worst part's. Each replica samples its own tensors,
    so the pooled figures approximate, not equal, those of the same version committed whole."""
    known = [p for p in parts if p is not None and p.sampled_elements]
    if not known:
        return None
    total = sum(p.sampled_elements for p in known)
    visible = [(v, p.sampled_elements) for p in known if (v := p.update_visibility) is not None]

    def mean(values: list[tuple[float, int]]) -> float:
        weight = sum(w for _, w in values)
        return sum(v * w for v, w in values) / weight

    return LagMetrics(
        churn=mean([(p.churn, p.sampled_elements) for p in known]),
        update_visibility=mean(visible) if visible else None,
        lag_steps=max(p.lag_steps for p in known),
        relative_error=math.sqrt(mean([(p.relative_error**2, p.sampled_elements) for p in known])),
        saturated_elements=sum(p.saturated_elements for p in parts if p is not None),
        sampled_elements=total,
        exact=all(p.exact for p in known),
    )


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


@dataclass(frozen=True)
class WindowSums:
    """One visibility window's sums over some elements, from version `start` to this one: they add
    across ranks, and `visibility_of` reads the estimate from their total."""

    start: int
    served_step: float  # <s_t - s_a, m_t - m_a>
    master_step: float  # ||m_t - m_a||^2
    noise: float  # sum of w = (e_t^2 + e_a^2)(m_t - m_a)^2
    noise_sq: float  # sum of w^2

    def __add__(self, other: WindowSums) -> WindowSums:
        return WindowSums(self.start, self.served_step + other.served_step, self.master_step + other.master_step,
                          self.noise + other.noise, self.noise_sq + other.noise_sq)


def window_sums(start: int, master: np.ndarray, served: np.ndarray, start_master: np.ndarray,
                start_served: np.ndarray) -> WindowSums:
    """The sums of a window over these elements (float64 arrays)."""
    dm = master - start_master
    err, start_err = served - master, start_served - start_master
    weights = (err * err + start_err * start_err) * (dm * dm)
    return WindowSums(start, _dot(served - start_served, dm), _dot(dm, dm), float(np.sum(weights)),
                      _dot(weights, weights))


def visibility_of(w: WindowSums) -> tuple[float, float] | None:
    """(visibility, its standard error) of a window's sums; None when the master did not move. The
    standard error is infinite when the rounding errors it is estimated from sit on fewer than
    VISIBILITY_MIN_ELEMENTS elements."""
    if w.master_step == 0:
        return None
    visibility = w.served_step / w.master_step
    if w.noise == 0:  # served exactly as the masters: no noise at all
        return visibility, 0.0
    if w.noise * w.noise < VISIBILITY_MIN_ELEMENTS * w.noise_sq:
        return visibility, math.inf
    return visibility, math.sqrt(w.noise) / w.master_step


def visibility_estimate(master: np.ndarray, served: np.ndarray, start_master: np.ndarray,
                        start_served: np.ndarray) -> tuple[float, float] | None:
    """(visibility, its standard error) over the window from `start_*` to `master`, `served`
    (float64); None when the master did not move (`visibility_of`)."""
    return visibility_of(window_sums(0, master, served, start_master, start_served))


@dataclass(frozen=True)
class LagSums:
    """A version's lag figures over some of its sampled elements (one rank's rows, or all of them),
    as sums and counts that add up across the ranks of a version (`combine`). `reference` and
    `previous` are the versions the figures are measured from: the run's first, and the last one
    these elements were observed at (None: none, this is the reference)."""

    reference: int
    previous: int | None
    distance_sq: float  # ||m_t - m_ref||^2
    progress: float  # <s_t - s_ref, m_t - m_ref>
    master_sq: float  # ||m_t||^2
    error_sq: float  # ||s_t - m_t||^2
    changed: int  # elements whose served bits differ from the previous version's
    compared: int  # elements compared with the previous version
    windows: tuple[WindowSums, ...]  # visibility windows, shortest first (none without a previous version)
    saturated: int
    sampled: int
    exact: bool

    def problem(self) -> str | None:
        """What makes these sums no elements' (a count below zero, a square sum below zero), or None."""
        if min(self.changed, self.compared, self.saturated, self.sampled) < 0:
            return "a count below zero"
        if self.changed > self.compared:
            return f"{self.changed} elements changed of {self.compared} compared"
        if any(x < 0 for x in (self.distance_sq, self.master_sq, self.error_sq,
                               *(v for w in self.windows for v in (w.master_step, w.noise, w.noise_sq)))):
            return "a sum of squares below zero"
        if self.previous is None and self.windows:
            return "visibility windows without a previous version"
        return None

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["windows"] = [dict(w.__dict__) for w in self.windows]
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> LagSums:
        """From `to_dict`'s JSON; KeyError, TypeError or ValueError when it is not one."""
        previous = d.get("previous")
        return LagSums(
            int(d["reference"]), None if previous is None else int(previous), float(d["distance_sq"]),
            float(d["progress"]), float(d["master_sq"]), float(d["error_sq"]), int(d["changed"]), int(d["compared"]),
            tuple(WindowSums(int(w["start"]), float(w["served_step"]), float(w["master_step"]), float(w["noise"]),
                             float(w["noise_sq"])) for w in d["windows"]),
            int(d["saturated"]), int(d["sampled"]), bool(d["exact"]))


def combine(parts: Sequence[LagSums]) -> LagSums:
    """The sums of a version from its ranks' (a sum of each): exact but for the order the float64
    additions ran in. ValueError, saying which, unless the ranks measured from the same reference,
    previous version and windows (ranks whose learner state parted ways: a rank restarted)."""
    first = parts[0]
    for i, p in enumerate(parts[1:], 1):
        for what, a, b in (("reference version", first.reference, p.reference),
                           ("previous version", first.previous, p.previous),
                           ("visibility windows from versions", [w.start for w in first.windows],
                            [w.start for w in p.windows])):
            if a != b:
                raise ValueError(f"part {i} measured from {what} {b}, part 0 from {a}")
    total = first
    for p in parts[1:]:
        total = replace(
            total, distance_sq=total.distance_sq + p.distance_sq, progress=total.progress + p.progress,
            master_sq=total.master_sq + p.master_sq, error_sq=total.error_sq + p.error_sq,
            changed=total.changed + p.changed, compared=total.compared + p.compared,
            windows=tuple(a + b for a, b in zip(total.windows, p.windows, strict=True)),
            saturated=total.saturated + p.saturated, sampled=total.sampled + p.sampled, exact=total.exact and p.exact)
    return total


@dataclass
class LagRows:
    """The state of some elements across versions (a push's whole sample, or one learner rank's rows):
    the reference's sample (the run's first version), the previous version's, and the visibility
    windows' anchors. `observe` turns a version's sample into its `LagSums`."""

    ref_version: int | None = None
    ref: Sample | None = None
    prev_version: int | None = None
    prev: Sample | None = None
    observed: int = 0  # versions observed since the reference (the reference is 0)
    # Per refresh period K: the (version, sample) of the two latest versions whose count is a multiple
    # of K (the older is None until there are two); the window starts at the older.
    anchors: dict[int, tuple[tuple[int, Sample] | None, tuple[int, Sample]]] = field(default_factory=dict)

    def snapshot(self) -> LagRows:
        return replace(self, anchors=dict(self.anchors))

    def observe(self, version: int, sample: Sample, saturated: int, exact: bool) -> LagSums:
        m, s = sample.master.astype(np.float64), sample.served.astype(np.float64)
        if self.ref is None or self.ref.master.shape != sample.master.shape:
            self.ref_version, self.ref, self.prev_version, self.prev = version, sample, None, None
            point = (version, Sample(sample.master, sample.served, _NO_BITS))
            self.observed, self.anchors = 0, {k: (None, point) for k in VISIBILITY_WINDOWS}
        else:
            self.observed += 1
        assert self.ref_version is not None
        ref_m, ref_s = self.ref.master.astype(np.float64), self.ref.served.astype(np.float64)
        changed = compared = 0
        windows: tuple[WindowSums, ...] = ()
        if self.prev is not None:
            changed, compared = int(np.count_nonzero(sample.bits != self.prev.bits)), int(sample.bits.size)
            windows = self._windows(version, sample, m, s)
        dm_ref = m - ref_m
        err = s - m
        sums = LagSums(self.ref_version, self.prev_version, _dot(dm_ref, dm_ref), _dot(s - ref_s, dm_ref), _dot(m, m),
                       _dot(err, err), changed, compared, windows, saturated, int(sample.master.size), exact)
        self.prev_version, self.prev = version, sample
        return sums

    def _windows(self, version: int, sample: Sample, m: np.ndarray, s: np.ndarray) -> tuple[WindowSums, ...]:
        """Advance the anchors to this version, then the sums of each window, shortest first."""
        point = (version, Sample(sample.master, sample.served, _NO_BITS))  # an anchor keeps no bits
        starts: list[tuple[int, Sample]] = []
        for period, (older, newer) in self.anchors.items():
            if self.observed % period == 0:
                older, newer = newer, point
                self.anchors[period] = (older, newer)
            start = older if older is not None else newer  # the run is younger than the period
            if all(start[0] != other[0] for other in starts):
                starts.append(start)
        return tuple(window_sums(v, m, s, a.master.astype(np.float64), a.served.astype(np.float64))
                     for v, a in starts)


@dataclass
class LagHistory:
    """Per model, what the figures of a version need beyond its sums: D_tau of every version since
    the reference."""

    ref_version: int | None = None
    distances: dict[int, float] = field(default_factory=dict)  # D_tau per committed version

    def snapshot(self) -> LagHistory:
        return LagHistory(self.ref_version, dict(self.distances))

    def figures(self, version: int, sums: LagSums) -> LagMetrics:
        """The version's lag metrics from its sums (of every element sampled), and D_t kept."""
        if sums.reference != self.ref_version:  # a new run (or a service that restarted within one)
            self.ref_version, self.distances = sums.reference, {sums.reference: 0.0}
        churn = sums.changed / sums.compared if sums.compared else 0.0
        visibility = None
        for w in sums.windows:
            estimate = visibility_of(w)
            if estimate is not None and estimate[1] <= VISIBILITY_MAX_SE:
                visibility = estimate[0]
                break
        d_t = math.sqrt(sums.distance_sq)
        self.distances[version] = d_t
        if d_t == 0:
            lag = 0
        else:
            s_t = sums.progress / d_t
            if s_t >= d_t * (1 - 1e-9):  # equal up to the rounding of the two float64 reductions
                lag = 0
            else:
                reached = [tau for tau, d in self.distances.items() if d <= s_t and tau <= version]
                lag = version - (max(reached) if reached else self.ref_version or 0)
        norm_m = math.sqrt(sums.master_sq)
        rel = math.sqrt(sums.error_sq) / norm_m if norm_m > 0 else 0.0
        return LagMetrics(churn, visibility, lag, rel, sums.saturated, sums.sampled, sums.exact)


@dataclass
class LagTracker:
    """A pushed model's lag: the service holds the whole sample (`rows`) and the history."""

    rows: LagRows = field(default_factory=LagRows)
    history: LagHistory = field(default_factory=LagHistory)

    def snapshot(self) -> LagTracker:
        return LagTracker(self.rows.snapshot(), self.history.snapshot())

    def observe(self, version: int, sample: Sample, saturated: int, exact: bool) -> LagMetrics:
        return self.history.figures(version, self.rows.observe(version, sample, saturated, exact))

    def published(self, version: int, sums: LagSums) -> LagMetrics:
        """A published version's figures from its ranks' combined sums. The rows' state is the
        learner's now: a later push starts a run of its own."""
        self.rows = LagRows()
        return self.history.figures(version, sums)
