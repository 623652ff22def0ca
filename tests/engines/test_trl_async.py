"""TRL's `AsyncGRPOTrainer` on weightsvc through its public doors (`WeightsvcTransfer`), every part real:
the weightsvc service, a `vllm serve` with weightsvc's backend that the trainer's transfer drives
(no `weightsvc follow`), and the trainer in its own environment (the showcase's `train`, as in
test_trl). Without CUDA the trainer's FlashAttention-3 tree attention and its device query are stood in
for (examples/async_grpo_cpu.py, checked in tests/unit/test_trl_async.py). A second run publishes the
served copy instead of pushing the masters (the showcase's `--publish`, to a service with NIXL)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import serving
from tests.engines.serving import BACKEND, VllmServer, vllm_serve
from tests.engines.test_trl import showcase, trainer_python
from weightsvc import InferenceClient
from weightsvc.integrations.fair_cast import masters_digest_of, served_state_dict
from weightsvc.rounding import ExportSpec
from weightsvc.server.server import BackgroundServer

pytestmark = pytest.mark.engine
STEPS = 3
COMPLETIONS, COMPLETION_LEN = 16, 4  # per step (the showcase's AsyncGRPOConfig)


@pytest.fixture(scope="module")
def service() -> Iterator[BackgroundServer]:
    with serving(rounding="sr") as srv:
        yield srv


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trl-async") / "model"
    showcase(trainer_python(), "build", "--model-dir", str(path))
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VllmServer]:
    """One engine for the module's runs: each run's first version replaces what it holds."""
    with vllm_serve(model_dir, model_dir.parent / "vllm.log", "--logprobs-mode", "processed_logprobs",
                    "--weight-transfer-config", BACKEND) as server:
        yield server


def train(service: BackgroundServer, engine: VllmServer, model_dir: Path, model: str, out: Path,
          *args: str) -> dict[str, Any]:
    showcase(trainer_python(), "train", "--model-dir", str(model_dir), "--target", service.grpc_target,
             "--engine", engine.url, "--model", model, "--rounding", "sr", "--out", str(out), *args, timeout=600)
    trace: dict[str, Any] = json.loads(out.read_text())
    return trace


def test_async_grpo_pushes_each_step_the_engine_serves_it_and_the_loss_runs_on_the_served_copy(
        service: BackgroundServer, engine: VllmServer, model_dir: Path, tmp_path: Path) -> None:
    model, capture = "trl-async", tmp_path / "capture"
    # max_staleness 0: TRL keeps only samples of its current version (as it reckons; see below).
    trace = train(service, engine, model_dir, model, tmp_path / "trace.json", "--steps", str(STEPS),
                  "--max-staleness", "0", "--capture", str(capture))
    # The transfer left the engine on the last step's version, generating under its label.
    assert engine.weight_version() == str(STEPS)
    assert engine.generate_one([1, 5, 9, 11])["weight_versions"] == [{"version": str(STEPS), "start": 0, "end": 16}]

    # One version per sync: the starting masters (0) at train begin, then one per optimizer step, each
    # with the service's lag, each swapped into the engine and acked by the transfer once it served it.
    with InferenceClient(service.grpc_target) as client:
        listed = {v.version: v for v in client.versions(model)}
        acked = {c.client_id: c.version for c in client.clients(model)}
        manifests = {v: client.manifest(model, v) for v in listed}
        pulled = {v: client.pull(model, v) for v in range(STEPS)}
    assert sorted(listed) == list(range(STEPS + 1))
    assert sorted(int(v) for v in trace["lag"]) == list(range(STEPS + 1))
    assert all(listed[v].rounding == "sr" for v in listed)
    assert acked == {f"trl-{model}": STEPS}
    # TRL's model_version n is the n-th sync's version: weightsvc version n - 1.
    assert {int(v): m for v, m in trace["model_versions"].items()} == {v: v + 1 for v in range(STEPS + 1)}
    assert trace["served_from"] == "local"  # (the learner's own bits matched the manifest's checksums)

    # Every trained token came from the engine, with the version that produced it: the step that scored
    # it on the served copy of version g trained tokens of version g - 1 (of 0 at the first step). TRL
    # judged them of staleness 0: its data loader (accelerate's dispatcher) draws the next batch, and
    # checks its staleness, before the sync of the step under way.
    assert trace["staleness_max"] == [0.0] * STEPS
    assert trace["trained_tokens"] == [COMPLETIONS * COMPLETION_LEN] * STEPS
    batches = trace["mismatch"]
    assert [b["step"] for b in batches] == list(range(STEPS))
    for b in batches:
        assert list(b["by_version"]) == [str(max(b["step"] - 1, 0))]
        m = b["by_version"][str(max(b["step"] - 1, 0))]
        # Each completion counts once (alike ones of a batch share their positions): all of them, unless
        # two of a prompt's eight came out alike, and whole.
        assert 0 < m["tokens"] <= COMPLETIONS * COMPLETION_LEN and m["tokens"] % COMPLETION_LEN == 0
        # The learner's log-probabilities at the engine's tokens: close (one version apart, the engine in
        # bf16 kernels), where tokens scored at the wrong positions are off by a nat or more.
        assert 0 < m["mean_abs_logp_delta"] < 0.3

    # The service holds what the learner reported, per version (version 0: the reports of steps 0 and 1).
    recorded = {int(v): m for v, m in trace["service_mismatch"].items()}
    assert sorted(recorded) == list(range(STEPS - 1))
    for version in recorded:
        mine = [b["by_version"][str(version)] for b in batches if str(version) in b["by_version"]]
        assert recorded[version]["tokens"] == sum(m["tokens"] for m in mine)

    # The loss ran on the served copy, bit for bit: at each step's loss forward, the weights the model read
    # are the Fair Cast export of the masters under them, which are those pushed as the version.
    for step in range(STEPS):
        read = load_file(str(capture / f"forward-{step}.safetensors"))
        masters = load_file(str(capture / f"masters-{step}.safetensors"))
        m = manifests[step]
        assert masters_digest_of(masters) == m.master_digest
        spec = ExportSpec(m.format, m.rounding, seed=m.seed)
        expected = served_state_dict(masters, spec, version=step)
        for name, value in read.items():
            assert value.dtype == torch.float32  # (the served values, exact in the masters' dtype)
            assert torch.equal(value.to(torch.bfloat16).view(torch.int16), expected[name].view(torch.int16)), name
            assert torch.equal(value.to(torch.bfloat16).view(torch.int16), pulled[step][name].view(torch.int16)), name
        if step >= 1:  # the masters have left the bf16 grid: the loss did not run on them
            assert any(not torch.equal(read[n], masters[n]) for n in read)


@pytest.fixture(scope="module")
def copier() -> Iterator[BackgroundServer]:
    """A service that READs published copies (`serve --nixl`), in sr: the showcase's `--publish` spec."""
    with serving(rounding="sr", nixl=True) as srv:
        yield srv


def test_async_grpo_in_publish_mode_commits_the_copy_the_loss_ran_on_and_the_engine_serves_it(
        copier: BackgroundServer, engine: VllmServer, model_dir: Path, tmp_path: Path) -> None:
    model, capture = "trl-async-publish", tmp_path / "capture"
    trace = train(copier, engine, model_dir, model, tmp_path / "trace.json", "--steps", str(STEPS),
                  "--max-staleness", "0", "--capture", str(capture), "--publish")
    assert (trace["publish"], trace["served_from"]) == (True, "published")
    assert engine.weight_version() == str(STEPS)  # the engine loaded each published version and swapped it in
    with InferenceClient(copier.grpc_target) as client:
        by_version = {v.version: v for v in client.versions(model)}
        listed = sorted(by_version)
        acked = {c.client_id: c.version for c in client.clients(model)}
        manifests = {v: client.manifest(model, v) for v in range(STEPS)}
        pulled = {v: client.pull(model, v) for v in range(STEPS)}
    assert listed == list(range(STEPS + 1)) and acked == {f"trl-{model}": STEPS}
    # Each version's lag is the one its ranks measured against their masters and the service recorded.
    recorded_lag = {v: info.lag.lag_steps for v, info in by_version.items() if info.lag is not None}
    assert {int(v): lag for v, lag in trace["lag"].items()} == recorded_lag and sorted(recorded_lag) == listed
    assert [b["step"] for b in trace["mismatch"]] == list(range(STEPS))

    # Each committed version is the service's export of the masters the step held, and the bytes the
    # step's loss forward read: the learner published the copy it trained on.
    spec = ExportSpec("bf16", "sr", seed=0)
    for step in range(STEPS):
        read = load_file(str(capture / f"forward-{step}.safetensors"))
        masters = load_file(str(capture / f"masters-{step}.safetensors"))
        assert masters_digest_of(masters) == manifests[step].master_digest
        expected = served_state_dict(masters, spec, version=step)
        for name, value in read.items():
            as_served = value.to(torch.bfloat16).view(torch.int16)
            assert torch.equal(as_served, expected[name].view(torch.int16)), name
            assert torch.equal(as_served, pulled[step][name].view(torch.int16)), name
        if step >= 1:
            assert any(not torch.equal(read[n], masters[n]) for n in read)
