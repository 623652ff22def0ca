"""A publish's lag sums on the wire (gRPC and the HTTP JSON) and the rule that adds ranks' sums up."""

from __future__ import annotations

import json

import numpy as np
import pytest

from weightsvc.errors import InvalidArgument
from weightsvc.protocol.lag import LagRows, LagTracker, Sample, combine
from weightsvc.protocol.published import (
    RankPublish,
    publish_from_dict,
    publish_from_proto,
    publish_to_dict,
    publish_to_proto,
)
from weightsvc.rounding import ExportSpec


def samples(versions: int, n: int = 4000) -> list[Sample]:
    rng = np.random.default_rng(0)
    start, drift = rng.normal(0, 0.02, n).astype(np.float32), rng.normal(0, 1e-4, n).astype(np.float32)
    out = []
    for v in range(versions):
        m = start + v * drift
        s = (m + rng.normal(0, 1e-5, n)).astype(np.float32)
        out.append(Sample(m, s, s.view(np.uint32) >> 16))
    return out


def test_two_halves_sums_added_up_give_the_whole_samples_figures() -> None:
    whole, halves, tracker = LagTracker(), [LagRows(), LagRows()], LagTracker()
    for version, s in enumerate(samples(6), 1):
        expected = whole.observe(version, s, 0, True)
        parts = [rows.observe(version, Sample(s.master[a:b], s.served[a:b], s.bits[a:b]), 0, True)
                 for rows, (a, b) in zip(halves, ((0, 1500), (1500, 4000)), strict=True)]
        got = tracker.published(version, combine(parts))
        assert (got.lag_steps, got.churn, got.sampled_elements) == (expected.lag_steps, expected.churn, 4000)
        assert got.relative_error == pytest.approx(expected.relative_error, rel=1e-12)
        assert (got.update_visibility is None) == (expected.update_visibility is None)


def test_sums_of_ranks_measured_from_different_versions_do_not_add_up() -> None:
    a, b = LagRows(), LagRows()
    s = samples(3)
    a.observe(1, s[0], 0, True)
    with pytest.raises(ValueError, match="part 1 measured from reference version 2, part 0 from 1"):
        combine([a.observe(2, s[1], 0, True), b.observe(2, s[1], 0, True)])


def test_the_sums_travel_over_grpc_and_json_and_bad_ones_are_refused_naming_the_rank() -> None:
    rows, s = LagRows(), samples(3)
    for version in (1, 2):
        sums = rows.observe(version, s[version], 3, False)
    p = RankPublish("m", 2, 1, 2, ExportSpec(), b"agent", "DRAM", (), lag=sums)
    assert publish_from_proto(publish_to_proto(p)) == p
    assert publish_from_dict("m", 2, json.loads(json.dumps(publish_to_dict(p)))) == p
    old = RankPublish("m", 2, 1, 2, ExportSpec(), b"agent", "DRAM", ())
    assert publish_from_proto(publish_to_proto(old)).lag is None  # (a client that predates lag)
    assert publish_from_dict("m", 2, publish_to_dict(old)).lag is None
    bad = RankPublish("m", 2, 1, 2, ExportSpec(), b"agent", "DRAM", (),
                      lag=sums.__class__(**{**sums.__dict__, "changed": sums.compared + 1}))
    with pytest.raises(InvalidArgument, match=r"model 'm' step 2 rank 1: its lag sums .*: 4001 elements changed"):
        bad.check()
