"""The trainer-rollout mismatch of the tokens generated under one weight version: what a learner
reports (`LearnerClient.report_mismatch`, `POST /v1/models/{model}/mismatch`) and what the service
accumulates per model and version.

Definitions follow verl's rollout-correction metrics (`compute_offpolicy_metrics`), with
r = exp(learner - engine) per token: `k3_kl` is the token mean of r - 1 - log r (the k3 estimator of
KL(engine ‖ learner): the tokens were sampled from the engine), `mean_abs_logp_delta` the token mean
of |log r|, `outside_band` the share of tokens whose r lies outside the IcePop band [low, high]
(`band`). The reports of one version must share a band: shares of different bands do not add up.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from weightsvc.v1 import weightsvc_pb2 as pb

MEANS = ("mean_abs_logp_delta", "k3_kl", "outside_band")
DEFAULT_BAND = (0.5, 2.0)
# A report's tokens, and a version's total over every report: integers a double holds exactly (Redis's
# Lua and JSON readers hold numbers as doubles), far beyond any count of generated tokens.
MAX_TOKENS = 2**53 - 1
# A mean per token: far above any real batch's (a token's k3 reaches 1e100 only at log r ≈ 230, a token
# the engine sampled at a probability under 1e-100), and low enough that a version's sums over
# MAX_TOKENS tokens stay finite.
MAX_MEAN = 1e100
Band = tuple[float, float]


def check_band(band: object) -> Band:
    """`band` as (low, high) with 0 < low < high < inf, or a `ValueError` naming it."""
    try:
        low, high = (float(x) for x in band)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise ValueError(f"the IcePop band is two numbers [low, high], not {band!r}") from None
    if not (0 < low < high and math.isfinite(high)):
        raise ValueError(f"the IcePop band must satisfy 0 < low < high < inf, not {[low, high]}")
    return low, high


@dataclass(frozen=True)
class RolloutMismatch:
    """Token means over `tokens` tokens of one weight version. Construction checks the values (a
    `ValueError` names the field): 0 < tokens ≤ MAX_TOKENS, every mean finite and in [0, MAX_MEAN],
    `outside_band` ≤ 1, `band` 0 < low < high < inf."""

    tokens: int
    mean_abs_logp_delta: float
    k3_kl: float
    outside_band: float
    band: Band = DEFAULT_BAND

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, numbers.Integral):
            raise ValueError(f"tokens must be an integer, not {self.tokens!r}")
        object.__setattr__(self, "tokens", int(self.tokens))  # (numpy and torch integers too)
        if self.tokens <= 0:
            raise ValueError(f"tokens must be > 0, not {self.tokens}")
        if self.tokens > MAX_TOKENS:
            raise ValueError(f"tokens must be at most {MAX_TOKENS}, not {_shown(self.tokens)}")
        for field in MEANS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{field} must be a number, not {value!r}")
            try:
                number = float(value)
            except OverflowError:  # (an integer beyond any double)
                number = math.inf
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"{field} must be finite and >= 0, not {_shown(value)}")
            if number > MAX_MEAN:
                raise ValueError(f"{field} must be at most {MAX_MEAN:g}, not {_shown(value)}")
            object.__setattr__(self, field, number)
        if self.outside_band > 1:
            raise ValueError(f"outside_band is a share of tokens, in [0, 1], not {self.outside_band}")
        object.__setattr__(self, "band", check_band(self.band))

    def combined(self, other: RolloutMismatch) -> RolloutMismatch:
        """Both reports as one: the token-weighted means over the tokens of both (of the same version
        and band; another band raises `ValueError`)."""
        if other.band != self.band:
            raise ValueError(f"the reports have different IcePop bands ({list(self.band)} and {list(other.band)}): "
                             "their outside_band shares do not add up")
        tokens = self.tokens + other.tokens
        a, b = self.tokens / tokens, other.tokens / tokens
        means = {f: bounded_mean(f, a * getattr(self, f) + b * getattr(other, f)) for f in MEANS}
        return RolloutMismatch(tokens, **means, band=self.band)

    __add__ = combined

    def as_dict(self) -> dict[str, float | int]:
        return {"tokens": self.tokens, **{f: getattr(self, f) for f in MEANS}, "band": list(self.band)}


def _shown(value: object) -> str:
    """A number as a message shows it: an integer of hundreds of digits by its first ones and its length."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"


def bounded_mean(field: str, value: float) -> float:
    """A mean made of token-weighted sums, within its field's bound: a rounding past it is still the
    bound, as every part it was made of was within it (a share above 1 is still "all")."""
    return min(value, 1.0 if field == "outside_band" else MAX_MEAN)


def combine(*reports: dict[int, RolloutMismatch]) -> dict[int, RolloutMismatch]:
    """Several per-version reports as one, each version's token-weighted (the batches of one step)."""
    out: dict[int, RolloutMismatch] = {}
    for report in reports:
        for version, m in report.items():
            out[version] = out[version].combined(m) if version in out else m
    return out


def mismatch_to_proto(m: RolloutMismatch) -> pb.RolloutMismatch:
    return pb.RolloutMismatch(tokens=m.tokens, mean_abs_logp_delta=m.mean_abs_logp_delta, k3_kl=m.k3_kl,
                              outside_band=m.outside_band, band_low=m.band[0], band_high=m.band[1])


def fields_from_proto(m: pb.RolloutMismatch) -> dict[str, Any]:
    """The fields of a `pb.RolloutMismatch`, unchecked (no band: the default one)."""
    band = DEFAULT_BAND if m.band_low == m.band_high == 0 else (m.band_low, m.band_high)
    return {"tokens": int(m.tokens), **{f: float(getattr(m, f)) for f in MEANS}, "band": band}


def mismatch_from_proto(m: pb.RolloutMismatch) -> RolloutMismatch:
    """A `pb.RolloutMismatch` as the dataclass (raises `ValueError` on a bad value)."""
    return RolloutMismatch(**fields_from_proto(m))
