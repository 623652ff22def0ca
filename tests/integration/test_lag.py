"""Lag metrics through a real server, on constructed cases with known answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import serving
from tests.helpers import http_get
from weightsvc import InferenceClient, LearnerClient
from weightsvc.protocol.lag import SAMPLE_TARGET, LagTracker, Sample
from weightsvc.rounding import FORMATS, decode, fair_cast


def bf16_exact(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16).float()


def test_a_served_copy_that_never_moves_lags_by_every_step() -> None:
    with serving(rounding="rtn", retain=10) as srv:
        x = bf16_exact((64, 64))
        start = (torch.sign(x) * (x.abs() + 0.01)).to(torch.bfloat16).float()  # all far from zero
        learner = LearnerClient(srv.grpc_target)
        for step in range(10, 16):  # tiny steps: round to nearest hides every one of them
            learner.push(step, {"w": start + 1e-7 * (step - 9)})
        lags = [v.lag for v in InferenceClient(srv.grpc_target).versions()]
        assert [lag.lag_steps for lag in lags] == [0, 1, 2, 3, 4, 5]
        assert all(lag.churn == 0 for lag in lags)
        assert all(lag.update_visibility == 0 for lag in lags[1:]) and lags[0].update_visibility is None
        assert all(lag.exact for lag in lags)


def test_a_served_copy_equal_to_the_master_does_not_lag() -> None:
    with serving(rounding="sr", retain=10) as srv:
        learner = LearnerClient(srv.grpc_target)
        for step in range(1, 6):  # bf16-exact masters are served as they are, whatever the rounding
            learner.push(step, {"w": bf16_exact((32, 32), seed=step)})
        lags = [v.lag for v in InferenceClient(srv.http_url).versions()]
        assert [lag.lag_steps for lag in lags] == [0] * 5
        assert all(lag.relative_error == 0 for lag in lags)
        assert all(lag.update_visibility == pytest.approx(1.0) for lag in lags[1:])
        assert all(lag.churn > 0.9 for lag in lags[1:])
        body = http_get(srv.http_url, "/metrics")[2].decode()
        samples = {(s.name, s.labels.get("rounding")): s.value for f in text_string_to_metric_families(body)
                   for s in f.samples if s.labels.get("model") == "default"}
        assert samples[("weightsvc_served_lag_steps", "sr")] == 0
        assert samples[("weightsvc_update_visibility_ratio", "sr")] == pytest.approx(1.0)
        assert samples[("weightsvc_served_relative_error", "sr")] == 0


def test_a_step_too_small_to_tell_from_rounding_noise_reads_nothing() -> None:
    """Steps of 1e-6 of the value under stochastic rounding: each version's ratio is rounding noise
    (a standard error of about 20 on these 4,096 elements), so no figure is told: None in the version
    lists and NaN on /metrics, never a number an alert on invisible updates would compare."""
    with serving(rounding="sr", retain=10) as srv:
        start = torch.randn((64, 64), generator=torch.Generator().manual_seed(11)) * 0.02  # off the bf16 grid
        learner = LearnerClient(srv.grpc_target)
        for step in range(1, 6):
            learner.push(step, {"w": start * (1 + 1e-6 * step)})
        lags = [v.lag for v in InferenceClient(srv.grpc_target).versions()]
        assert [lag.update_visibility for lag in lags] == [None] * 5
        assert all(lag.churn > 0.1 for lag in lags[1:])  # the served copy does move: by rounding noise
        body = http_get(srv.http_url, "/metrics")[2].decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples
                   if s.labels.get("model") == "default"}
        assert math.isnan(samples["weightsvc_update_visibility_ratio"])


def exact_metrics(masters: list[torch.Tensor], rounding: str) -> list[tuple[float, float | None, int, float]]:
    tracker = LagTracker()
    out = []
    for step, m in enumerate(masters, start=1):
        served = fair_cast(m, rounding=rounding, version=step, name="w").reshape(-1)
        bits = served.view(torch.int16).numpy().view(np.uint16)
        sample = Sample(m.reshape(-1).numpy(), decode(bits, FORMATS["bf16"]), bits.astype(np.uint32))
        lag = tracker.observe(step, sample, 0, True)
        out.append((lag.churn, lag.update_visibility, lag.lag_steps, lag.relative_error))
    return out


@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_sampled_metrics_agree_with_exact_ones(rounding: str) -> None:
    """A model 4x the sample: the sampled figures stay within the stated tolerance of the exact ones
    (churn and visibility ±0.02 absolute, relative error ±2%, lag ±1 step)."""
    with serving(rounding=rounding, retain=10) as srv:
        gen = torch.Generator().manual_seed(3)
        m = bf16_exact((4 * SAMPLE_TARGET // 1024, 1024))
        masters = []
        for _ in range(8):
            m = m + torch.randn(m.shape, generator=gen) * 2e-5 + 1e-5  # drift plus noise
            masters.append(m.clone())
        learner = LearnerClient(srv.grpc_target)
        for step, master in enumerate(masters, start=1):
            learner.push(step, {"w": master})
        sampled = [v.lag for v in InferenceClient(srv.grpc_target).versions()]
        assert all(not lag.exact and lag.sampled_elements == SAMPLE_TARGET for lag in sampled)
        for lag, (churn, visibility, steps, rel) in zip(
            sampled[-4:], exact_metrics(masters, rounding)[-4:], strict=True
        ):
            assert abs(lag.churn - churn) < 0.02
            assert visibility is not None and abs(lag.update_visibility - visibility) < 0.02
            assert abs(lag.lag_steps - steps) <= 1
            assert math.isclose(lag.relative_error, rel, rel_tol=0.02)


def test_serving_staleness_from_acks() -> None:
    with serving(retain=10) as srv:
        learner = LearnerClient(srv.grpc_target)
        for step in (1, 2, 3):
            learner.push(step, {"w": bf16_exact((8, 8), seed=step)})
        InferenceClient(srv.grpc_target).ack("default", 1, "pod-a")  # two versions behind
        InferenceClient(srv.grpc_target).ack("default", 3, "pod-b")
        InferenceClient(srv.grpc_target).ack("default", 3, "pod-b")  # the same version again: one sync
        body = http_get(srv.http_url, "/metrics")[2].decode()
        samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(body)
                   for s in f.samples if s.labels.get("model") == "default"}
        assert samples[("weightsvc_clients", None)] == 2
        assert samples[("weightsvc_client_lag_versions", None)] == 2
        assert samples[("weightsvc_client_staleness_versions_bucket", "0")] == 1
        assert samples[("weightsvc_client_staleness_versions_bucket", "2")] == 2
        assert samples[("weightsvc_version_sync_seconds_count", None)] == 2
        clients = json.loads(http_get(srv.http_url, "/v1/models/default/clients")[2])["clients"]
        assert {(c["client_id"], c["lag_versions"], c["connected"]) for c in clients} == {
            ("pod-a", 2, True),
            ("pod-b", 0, True),
        }


def test_small_tensors_exported_together_give_the_metrics_and_bits_of_one_export_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many small tensors travel packed and are exported in one kernel call, their samples taken
    with one index array: the version must be the one a chunk-by-chunk export makes."""
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 400, (3000,), generator=gen).tolist()
    first = {f"layers.{i}.w": torch.randn(n, generator=gen) * 0.01 for i, n in enumerate(sizes)}
    second = {k: v + 1e-4 * torch.randn(v.shape, generator=gen) for k, v in first.items()}

    def pushed(batch_small: bool = True) -> tuple[object, list[str], str]:
        with serving() as srv, LearnerClient(srv.grpc_target) as learner:
            srv.service.pushes.context.batch_small = batch_small
            learner.push(1, first)
            learner.push(2, second)
            m = InferenceClient(srv.grpc_target).manifest()
            return m.lag, [t.checksum for t in m.tensors], m.master_digest

    together = pushed()

    assert pushed(batch_small=False) == together


def test_a_model_that_changes_its_export_keeps_only_the_series_of_the_new_one() -> None:
    """The lag series of an export a model no longer runs go: an alert on rtn's lag must stop once
    the model serves sr."""
    with serving(retain=10) as srv, LearnerClient(srv.grpc_target) as learner:
        for step, rounding in ((1, "rtn"), (2, "rtn"), (3, "sr"), (4, "sr")):
            learner.push(step, {"w": bf16_exact((32, 32), seed=step)}, rounding=rounding)
            learner.push(step, {"w": bf16_exact((32, 32), seed=step)}, model="other", rounding="rtn")
        body = http_get(srv.http_url, "/metrics")[2].decode()
        lag_series = {(s.labels["model"], s.labels["rounding"]) for f in text_string_to_metric_families(body)
                      for s in f.samples if s.name == "weightsvc_served_lag_steps"}
        assert lag_series == {("default", "sr"), ("other", "rtn")}
