"""Lag metrics of the served copy against the learner's masters.

Computed per committed version on a fixed, deterministic sample of elements: every `stride`-th
flat element of every tensor, with `stride` chosen so that a model contributes about
SAMPLE_TARGET elements. Memory stays constant (the sample of the first version, of the previous
one, and one distance per version); for models of at most SAMPLE_TARGET elements it is exact.

- churn: share of served elements whose bits differ from the previous version;
- update visibility: <s_t - s_p, m_t - m_p> / ||m_t - m_p||^2, the share of the step's update that
  reached the served copy (None when the master did not move);
- lag in steps: with D_tau = ||m_tau - m_ref|| and S_t = <s_t - s_ref, m_t - m_ref> / D_t,
  lag_t = t - max{tau <= t : D_tau <= S_t} (0 when S_t >= D_t);
- relative error ||s_t - m_t|| / ||m_t||; saturated elements (exact, from the export).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from weightsvc.core.manifest import LagMetrics

SAMPLE_TARGET = 1 << 18


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


@dataclass
class LagTracker:
    """Per model: the reference (first version of the run), the previous version, and D_tau."""

    ref_version: int | None = None
    ref: Sample | None = None
    prev: Sample | None = None
    distances: dict[int, float] = field(default_factory=dict)  # D_tau per committed version

    def snapshot(self) -> LagTracker:
        return copy.copy(self) if not self.distances else LagTracker(self.ref_version, self.ref, self.prev,
                                                                      dict(self.distances))  # fmt: skip

    def observe(self, version: int, sample: Sample, saturated: int, exact: bool) -> LagMetrics:
        m, s = sample.master.astype(np.float64), sample.served.astype(np.float64)
        if self.ref is None or self.ref.master.shape != sample.master.shape:
            self.ref_version, self.ref, self.prev, self.distances = version, sample, None, {}
        ref_m, ref_s = self.ref.master.astype(np.float64), self.ref.served.astype(np.float64)
        churn, visibility = 0.0, None
        if self.prev is not None:
            churn = float(np.mean(sample.bits != self.prev.bits)) if sample.bits.size else 0.0
            dm = m - self.prev.master
            norm2 = _dot(dm, dm)
            if norm2 > 0:
                visibility = _dot(s - self.prev.served, dm) / norm2
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
