"""verl's rollout correction on a batch of trajectories from several weight versions, and the mismatch
by version that `rollout_correction` adds and reports to the service.

The batch is verl's `DataProto` as its trainer holds it before the correction: the learner's
`old_log_probs`, the engine's `rollout_log_probs`, `response_mask`, and per trajectory the versions
its server labelled it with (`min_global_steps`, `max_global_steps`). The oracle is written out here
in float64 from the definitions (k3 = r - 1 - log r, r = exp(old - rollout)), not by the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig

from tests.conftest import make_masters, serving
from weightsvc import InferenceClient, LearnerClient
from weightsvc.integrations.verl import UNKNOWN_VERSION, rollout_correction, token_versions

WIDTH = 6  # response tokens per row


def trajectories() -> DataProto:
    """Rows of versions 3, 3, 5 and one resumed across 3 -> 5; the last tokens of some rows are padding.
    Row 1's token 2 lies far outside the rest (r = e^3): rejection sampling drops it."""
    gen = torch.Generator().manual_seed(11)
    rollout = -torch.rand(4, WIDTH, generator=gen, dtype=torch.float64).float() * 2
    old = rollout + torch.randn(4, WIDTH, generator=gen).float() * 0.2
    old[1, 2] = rollout[1, 2] + 3.0
    mask = torch.ones(4, WIDTH)
    mask[0, 4:] = 0
    mask[2, 5:] = 0
    return DataProto.from_dict(
        tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask},
        non_tensors={"min_global_steps": np.array([3, 3, 5, 3], dtype=object),
                     "max_global_steps": np.array([3, 3, 5, 5], dtype=object)})


def by_formula(batch: DataProto, rows: list[int], mask: torch.Tensor) -> tuple[int, float, float, float]:
    """tokens, mean |log r|, mean k3, share outside [0.5, 2] over the masked tokens of `rows`."""
    d = [float(batch.batch["old_log_probs"][r, t]) - float(batch.batch["rollout_log_probs"][r, t])
         for r in rows for t in range(WIDTH) if mask[r, t]]
    k3 = [math.exp(x) - 1 - x for x in d]
    outside = [not (0.5 <= math.exp(x) <= 2.0) for x in d]
    return len(d), sum(map(abs, d)) / len(d), sum(k3) / len(d), sum(outside) / len(d)


def test_each_token_has_the_version_of_its_trajectory_unless_it_spans_several() -> None:
    versions = token_versions(trajectories())
    assert versions.tolist() == [[3] * WIDTH, [3] * WIDTH, [5] * WIDTH, [UNKNOWN_VERSION] * WIDTH]


def test_the_mismatch_is_taken_by_version_over_the_tokens_the_correction_keeps(model: str) -> None:
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                                     rollout_rs_threshold="0.2_5.0")
    batch = trajectories()
    mask_before = batch.batch["response_mask"].clone()
    with serving() as srv, LearnerClient(srv.grpc_target) as learner:
        for version in (3, 5):
            learner.push(version, make_masters(seed=version), model)
        corrected, metrics, by_version = rollout_correction(batch, config, learner=learner, model=model, step=6)
        with InferenceClient(srv.grpc_target) as client:
            listed = {v.version: v.mismatch for v in client.versions(model)}

    # verl's own correction: token weights exp(old - rollout), truncated at 2, zero on padding and on
    # the token rejection sampling dropped
    kept = corrected.batch["response_mask"]
    assert kept[1, 2] == 0 and int(mask_before.sum() - kept.sum()) == 1
    ratio = torch.exp(batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"])
    assert torch.allclose(corrected.batch["rollout_is_weights"], ratio.clamp(max=2.0) * mask_before)
    assert "rollout_corr/k3_kl" in metrics

    # by version over the kept tokens of the rows of one version; the spanning row is counted apart
    assert sorted(by_version) == [3, 5]
    for version, rows in ((3, [0, 1]), (5, [2])):
        tokens, abs_delta, k3, outside = by_formula(batch, rows, kept)
        m = by_version[version]
        assert m.tokens == tokens
        assert m.mean_abs_logp_delta == pytest.approx(abs_delta, rel=1e-12)
        assert m.k3_kl == pytest.approx(k3, rel=1e-12)
        assert m.outside_band == pytest.approx(outside, rel=1e-12)
    assert metrics["weightsvc/unversioned_tokens"] == WIDTH
    # reported: the service holds the same per version
    assert listed[3] == by_version[3] and listed[5] == by_version[5]
