"""The trainer-rollout mismatch of the tokens generated under one weight version: what a learner
reports (`LearnerClient.report_mismatch`, `POST /v1/models/{model}/mismatch`) and what the service
accumulates per model and version.

Definitions follow verl's rollout-correction metrics (`compute_offpolicy_metrics`), with
r = exp(learner - engine) per token: `k3_kl` is the token mean of r - 1 - log r (the k3 estimator of
KL(engine ‖ learner): the tokens were sampled from the engine), `mean_abs_logp_delta` the token mean
of |log r|, `outside_band` the share of tokens whose r lies outside the IcePop band [low, high].
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from weightsvc.v1 import weightsvc_pb2 as pb

MEANS = ("mean_abs_logp_delta", "k3_kl", "outside_band")


@dataclass(frozen=True)
class RolloutMismatch:
    """Token means over `tokens` tokens of one weight version. Construction checks the values (a
    `ValueError` names the field): tokens > 0, every mean finite and ≥ 0, `outside_band` ≤ 1."""

    tokens: int
    mean_abs_logp_delta: float
    k3_kl: float
    outside_band: float

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, numbers.Integral):
            raise ValueError(f"tokens must be an integer, not {self.tokens!r}")
        object.__setattr__(self, "tokens", int(self.tokens))  # (numpy and torch integers too)
        if self.tokens <= 0:
            raise ValueError(f"tokens must be > 0, not {self.tokens}")
        for field in MEANS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{field} must be a number, not {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{field} must be finite and >= 0, not {value}")
            object.__setattr__(self, field, float(value))
        if self.outside_band > 1:
            raise ValueError(f"outside_band is a share of tokens, in [0, 1], not {self.outside_band}")

    def combined(self, other: RolloutMismatch) -> RolloutMismatch:
        """Both reports as one: the token-weighted means over the tokens of both (of the same version)."""
        tokens = self.tokens + other.tokens
        a, b = self.tokens / tokens, other.tokens / tokens
        means = {f: a * getattr(self, f) + b * getattr(other, f) for f in MEANS}
        means["outside_band"] = min(means["outside_band"], 1.0)  # (a rounding above 1 is still "all")
        return RolloutMismatch(tokens, **means)

    __add__ = combined

    def as_dict(self) -> dict[str, float | int]:
        return {"tokens": self.tokens, **{f: getattr(self, f) for f in MEANS}}


def combine(*reports: dict[int, RolloutMismatch]) -> dict[int, RolloutMismatch]:
    """Several per-version reports as one, each version's token-weighted (the batches of one step)."""
    out: dict[int, RolloutMismatch] = {}
    for report in reports:
        for version, m in report.items():
            out[version] = out[version].combined(m) if version in out else m
    return out


def mismatch_to_proto(m: RolloutMismatch) -> pb.RolloutMismatch:
    return pb.RolloutMismatch(tokens=m.tokens, mean_abs_logp_delta=m.mean_abs_logp_delta, k3_kl=m.k3_kl,
                              outside_band=m.outside_band)


def fields_from_proto(m: pb.RolloutMismatch) -> dict[str, int | float]:
    """The fields of a `pb.RolloutMismatch`, unchecked."""
    return {"tokens": int(m.tokens), **{f: float(getattr(m, f)) for f in MEANS}}


def mismatch_from_proto(m: pb.RolloutMismatch) -> RolloutMismatch:
    """A `pb.RolloutMismatch` as the dataclass (raises `ValueError` on a bad value)."""
    return RolloutMismatch(**fields_from_proto(m))  # type: ignore[arg-type]
