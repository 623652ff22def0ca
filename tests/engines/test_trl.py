"""TRL's `GRPOTrainer` on weightsvc (`FairCastGRPOTrainer`), every part real: the weightsvc service, a
`vllm serve` that `weightsvc follow` keeps on the latest version, and the trainer in its own environment:
the checkout's `.venv` with the `trl` extra (or $WEIGHTSVC_TRAINER_PYTHON), since vLLM pins its own
transformers here. The trainer reaches the engine over HTTP, as in a deployment."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import serving
from tests.engines.serving import BACKEND, following, vllm_serve
from weightsvc import InferenceClient
from weightsvc.server.server import BackgroundServer

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
SHOWCASE = ROOT / "examples" / "grpo_showcase.py"
STEPS = 3
BATCH_TOKENS = 16 * 4  # per rollout batch: 16 completions of 4 tokens (the showcase's GRPOConfig)


def trainer_python() -> str:
    python = os.environ.get("WEIGHTSVC_TRAINER_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    probe = subprocess.run([python, "-c", "import trl"], capture_output=True, text=True)
    if probe.returncode != 0:  # an error, never a skip: this test is what checks the integration
        pytest.fail(f"the trainer's python {python} cannot import trl (pip install -e '.[trl]' there, or set "
                    f"WEIGHTSVC_TRAINER_PYTHON):\n{probe.stderr[-2000:]}")
    return python


def showcase(python: str, *args: str, timeout: float = 300) -> None:
    done = subprocess.run([python, str(SHOWCASE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@contextlib.contextmanager
def trained(service: BackgroundServer, tmp_path: Path, model: str, steps: int) -> Iterator[tuple[Any, Any, Path]]:
    """The showcase's trainer run for `steps` steps (sr) against a `vllm serve` that follows `model`:
    yields the engine and its follower, still up, and the trace the run wrote."""
    python = trainer_python()
    model_dir, out = tmp_path / "model", tmp_path / "trace.json"
    showcase(python, "build", "--model-dir", str(model_dir))
    with (vllm_serve(model_dir, tmp_path / "vllm.log", "--logprobs-mode", "processed_logprobs",
                     "--weight-transfer-config", BACKEND) as engine,
          following(engine, service.grpc_target, model) as follower):
        showcase(python, "train", "--trainer", "grpo", "--model-dir", str(model_dir), "--target", service.grpc_target,
                 "--engine", engine.url, "--model", model, "--rounding", "sr", "--steps", str(steps), "--out", str(out))
        yield engine, follower, out


@pytest.fixture(scope="module")
def service() -> Iterator[BackgroundServer]:
    with serving(rounding="sr") as srv:
        yield srv


def test_grpo_pushes_each_step_rolls_out_on_the_following_engine_and_reports_mismatch_per_version(
        service: BackgroundServer, tmp_path: Path) -> None:
    model = "trl-grpo"
    with trained(service, tmp_path, model, STEPS) as (engine, follower, out):
        follower.wait_for("update", version=STEPS)  # the last step's version reaches the engine too
        assert engine.weight_version() == str(STEPS)
    trace: dict[str, Any] = json.loads(out.read_text())

    # One version per optimizer step (and the starting masters as version 0), each with the service's lag.
    with InferenceClient(service.grpc_target) as client:
        listed = {v.version: v for v in client.versions(model)}
    assert sorted(listed) == list(range(STEPS + 1))
    assert sorted(int(v) for v in trace["lag"]) == list(range(STEPS + 1))
    assert all(listed[v].rounding == "sr" for v in listed)
    # The learner recomputed the served bits itself (checked against the manifest at version 0).
    assert trace["served_from"] == "local"

    # Each rollout batch was generated, on policy, by the version of its step, every token scored by
    # the engine; TRL's importance-sampling correction ran on those log-probabilities.
    batches = trace["mismatch"]
    assert [b["step"] for b in batches] == list(range(STEPS))
    for b in batches:
        assert list(b["by_version"]) == [str(b["step"])]
        m = b["by_version"][str(b["step"])]
        assert m["tokens"] == BATCH_TOKENS
        # The learner runs the served bits in fp32, the engine in bf16 kernels: close, not equal. Tokens
        # scored at the wrong position, or by another policy, are off by a nat or more.
        assert 0 < m["mean_abs_logp_delta"] < 0.3
    assert all(r is not None and r > 0 for r in trace["is_ratio"])

    # The service holds what the learner reported, per version.
    recorded = {int(v): m for v, m in trace["service_mismatch"].items()}
    assert sorted(recorded) == list(range(STEPS))
    for b in batches:
        mine = b["by_version"][str(b["step"])]
        assert recorded[b["step"]]["tokens"] == mine["tokens"]
        assert recorded[b["step"]]["k3_kl"] == pytest.approx(mine["k3_kl"], rel=1e-6)

    # Each batch was also scored on the masters and on a round-to-nearest copy (a diagnostic, not reported).
    assert [b["step"] for b in trace["ablation"]] == list(range(STEPS))
    for b in trace["ablation"]:
        assert b["by_copy"]["served"] == batches[b["step"]]["by_version"][str(b["step"])]
