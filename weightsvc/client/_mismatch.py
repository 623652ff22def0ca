"""The trainer-rollout mismatch of a batch of rollouts, per weight version (pure torch).

    by_version = rollout_mismatch(learner_logprobs, engine_logprobs, versions, mask=response_mask)
    learner.report_mismatch("default", by_version, step=step)

`versions` holds, per token, the weight version it was generated under (vLLM's per-token
`weight_versions` spans, SGLang's `weight_versions`): a request paused across an update counts its
tokens under both versions. Definitions: `weightsvc.protocol.mismatch`.
"""

from __future__ import annotations

import math

import torch

from weightsvc.protocol.mismatch import RolloutMismatch

IcePopBand = tuple[float, float]


def _check(learner: torch.Tensor, engine: torch.Tensor, versions: torch.Tensor, mask: torch.Tensor | None,
           band: IcePopBand) -> None:
    if learner.shape != engine.shape or learner.shape != versions.shape:
        raise ValueError(f"learner_logprobs {list(learner.shape)}, engine_logprobs {list(engine.shape)} and "
                         f"versions {list(versions.shape)} must have the same shape")
    if learner.dim() not in (1, 2):
        raise ValueError(f"per-token logprobs are 1-D (tokens) or 2-D (sequences x tokens), not {learner.dim()}-D")
    if not learner.is_floating_point() or not engine.is_floating_point():
        raise ValueError(f"logprobs must be floating point, not {learner.dtype} and {engine.dtype}")
    if versions.is_floating_point() or versions.is_complex() or versions.dtype == torch.bool:
        raise ValueError(f"versions must be an integer tensor, not {versions.dtype}")
    if mask is not None and mask.shape != learner.shape:
        raise ValueError(f"mask {list(mask.shape)} must have the shape of the logprobs {list(learner.shape)}")
    low, high = band
    if not 0 < low < high or not math.isfinite(high):
        raise ValueError(f"the IcePop band must satisfy 0 < low < high < inf, not {band}")


def rollout_mismatch(
    learner_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    versions: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    band: IcePopBand = (0.5, 2.0),
) -> dict[int, RolloutMismatch]:
    """The mismatch between the learner's and the inference engine's per-token logprobs, per weight
    version: `{version: RolloutMismatch}` over the tokens `mask` keeps (non-zero; all when None).

    With r = exp(learner - engine): `k3_kl` is the token mean of r - 1 - log r (verl's `k3_kl`, an
    estimate of KL(engine ‖ learner)), `mean_abs_logp_delta` of |log r|, `outside_band` the share of
    tokens with r < low or r > high. Computed in float64; versions without a kept token are absent.
    A kept token whose logprob is not finite, or whose version is negative, raises `ValueError`."""
    _check(learner_logprobs, engine_logprobs, versions, mask, band)
    keep = torch.ones_like(versions, dtype=torch.bool) if mask is None else mask.to(versions.device) != 0
    learner = learner_logprobs.detach().to(versions.device, torch.float64)[keep]
    engine = engine_logprobs.detach().to(versions.device, torch.float64)[keep]
    version = versions[keep].to(torch.int64)
    for name, values in (("learner_logprobs", learner), ("engine_logprobs", engine)):
        if not bool(torch.isfinite(values).all()):  # (counted only when there is something to say)
            bad = int((~torch.isfinite(values)).sum())
            raise ValueError(f"{name} has {bad} token(s) that are not finite (NaN or ±inf) among those kept")
    if version.numel() and int(version.min()) < 0:
        raise ValueError(f"versions must be >= 0 for kept tokens (mask out tokens without one), "
                         f"not {int(version.min())}")
    if version.numel() == 0:
        return {}
    log_r = learner - engine
    k3 = (torch.expm1(log_r) - log_r).clamp_min(0)  # (≥ 0 exactly; expm1 keeps small deltas accurate)
    outside = (log_r < math.log(band[0])) | (log_r > math.log(band[1]))
    found, group = torch.unique(version, return_inverse=True)
    n = len(found)
    tokens = torch.bincount(group, minlength=n)
    sums = [torch.zeros(n, dtype=torch.float64, device=version.device).index_add_(0, group, x.to(torch.float64))
            for x in (log_r.abs(), k3, outside)]
    return {
        int(v): RolloutMismatch(int(t), *(float(s[i]) / int(t) for s in sums))
        for i, (v, t) in enumerate(zip(found.tolist(), tokens.tolist(), strict=True))
    }
