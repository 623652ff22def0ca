"""The service serves exactly what `weightsvc.rounding` computes locally: every format and mode,
fp8 scales, the ef residual across versions and restarts, and per-push overrides."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import make_masters, serving
from tests.helpers import same_bits
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import served_weights
from weightsvc.errors import InvalidArgument
from weightsvc.rounding import ExportSpec, Residual, export_state_dict


def steps(n: int) -> list[dict[str, torch.Tensor]]:
    base = make_masters(seed=5)
    return [{k: v + 1e-4 * i for k, v in base.items()} for i in range(n)]


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("rounding", ["rtn", "sr", "sr-sticky", "ef"])
def test_served_copy_is_the_local_fair_cast(fmt: str, rounding: str) -> None:
    with serving(format=fmt, rounding=rounding, seed=3, scaling="block", chunk_bytes=4096) as srv:
        learner = LearnerClient(srv.grpc_target, chunk_bytes=8192)  # several chunks per tensor
        spec = ExportSpec(fmt, rounding, 3, "block")
        residual = Residual()
        for step, masters in enumerate(steps(3), start=1):
            learner.push(step, masters)
            expected = export_state_dict(masters, spec, version=step, residual=residual)
            same_bits(InferenceClient(srv.grpc_target).pull(version=step), expected)
        manifest = InferenceClient(srv.http_url).manifest()
        assert (manifest.format, manifest.rounding, manifest.seed) == (fmt, rounding, 3)
        assert manifest.scaling == ("block" if fmt.startswith("fp8") else "")


def test_per_push_override(model: str) -> None:
    with serving() as srv:
        masters = make_masters()
        info = LearnerClient(srv.grpc_target).push(1, masters, model=model, format="fp16", rounding="rtn")
        assert (info.format, info.rounding) == ("fp16", "rtn")
        same_bits(InferenceClient(srv.grpc_target).pull(model),
                  export_state_dict(masters, ExportSpec("fp16", "rtn"), version=1))
        with pytest.raises(InvalidArgument, match="unknown format 'int4'"):
            LearnerClient(srv.grpc_target).push(2, masters, model=model, format="int4")


def test_ef_residual_survives_a_restart(data_dir: Path) -> None:
    spec = ExportSpec("bf16", "ef")
    residual = Residual()
    masters = steps(4)
    expected = [export_state_dict(m, spec, version=i, residual=residual) for i, m in enumerate(masters, 1)]
    with serving(data_dir=data_dir, rounding="ef") as srv:
        for i in (1, 2):
            LearnerClient(srv.grpc_target).push(i, masters[i - 1])
    model_dir = data_dir / "models" / "default"
    assert [p.name for p in model_dir.glob("residual-*")] == [f"residual-{2:020d}.safetensors"]
    # A crash between the residual of step 3 and its version file leaves an orphan: never used.
    orphan = Residual(3, {name: np.full(t.numel(), 0.5, np.float32) for name, t in masters[2].items()})
    orphan.save(model_dir / f"residual-{3:020d}.safetensors")
    with serving(data_dir=data_dir, rounding="ef") as srv:
        for i in (3, 4):
            LearnerClient(srv.grpc_target).push(i, masters[i - 1])
            same_bits(InferenceClient(srv.grpc_target).pull(version=i), expected[i - 1])


def test_ef_continues_only_from_an_ef_version_of_the_same_format() -> None:
    with serving(rounding="ef") as srv:
        learner = LearnerClient(srv.grpc_target)
        masters = steps(4)
        learner.push(1, masters[0])
        learner.push(2, masters[1], rounding="sr")  # breaks the ef chain
        learner.push(3, masters[2])
        fresh = export_state_dict(masters[2], ExportSpec("bf16", "ef"), version=3, residual=Residual())
        same_bits(InferenceClient(srv.grpc_target).pull(version=3), fresh)
        learner.push(4, masters[3], format="fp16")  # another format: starts from zero too
        fresh = export_state_dict(masters[3], ExportSpec("fp16", "ef"), version=4, residual=Residual())
        same_bits(InferenceClient(srv.grpc_target).pull(version=4), fresh)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_return_served_equals_the_local_bits_across_ef_steps(fmt: str) -> None:
    with serving(format=fmt, rounding="ef", scaling="block") as srv:
        learner = LearnerClient(srv.grpc_target)
        residual = Residual()
        for step, masters in enumerate(steps(3), start=1):
            info = learner.push(step, masters, return_served=True)
            assert info.served is not None
            local = export_state_dict(masters, ExportSpec(fmt, "ef", 0, "block"), version=step, residual=residual)
            same_bits(info.served, local)


def test_served_weights_runs_the_module_on_the_served_copy_and_keeps_the_masters() -> None:
    with serving(format="fp8_e4m3", rounding="sr") as srv:
        torch.manual_seed(0)
        policy = torch.nn.Sequential(torch.nn.Linear(256, 192), torch.nn.Tanh(), torch.nn.Linear(192, 8))
        masters = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        info = LearnerClient(srv.grpc_target).push(1, policy.state_dict(), return_served=True)
        assert info.served is not None and info.served["0.weight"].dtype == torch.float8_e4m3fn
        x = torch.randn(4, 256)
        with served_weights(policy, info.served):
            out = policy(x)
            out.sum().backward()
            w = policy[0].weight.detach()
            assert not torch.equal(w, masters["0.weight"])  # the served (quantized) values
            assert (w - masters["0.weight"]).abs().max() < 0.01
        for name, p in policy.named_parameters():
            assert torch.equal(p.detach(), masters[name]) and p.grad is not None  # masters back, grads kept
        with pytest.raises(KeyError, match="no tensor"), served_weights(policy, {}):
            pass


def test_the_export_time_metric_is_the_time_spent_exporting() -> None:
    """`weightsvc_export_seconds` observes each push's export time: more than nothing, less than
    the push took, in the bucket that fits it."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    with serving() as srv, LearnerClient(srv.grpc_target) as learner:
        masters = make_masters()
        masters["many.small"] = torch.randn(64)  # exported with other small chunks, in one call
        masters["one.big"] = torch.randn(1 << 20)  # chunk by chunk
        start = time.monotonic()
        for step in (1, 2):
            learner.push(step, masters)
        took = time.monotonic() - start
        text = srv.server.service.metrics.render().decode()  # type: ignore[union-attr]
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name.startswith("weightsvc_export_seconds")}
        assert samples["weightsvc_export_seconds_count"] == 2
        assert 0 < samples["weightsvc_export_seconds_sum"] < took
