"""The lag metrics a version carries: how far its served copy trails the learner's masters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


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
