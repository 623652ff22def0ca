"""The TRL integration in publish mode (`publish=True`, a real `weightsvc serve --nixl` on ports 0): each
sync publishes the served copy the learner exported, the service READs it over NIXL and commits it, and
the learner's forwards run on those very tensors. The committed version is bit for bit the service's own
export of the same masters (pushed as fp32 to another model of the same server). A real
`AsyncGRPOTrainer` (on the CPU, as in test_trl_async) drives `WeightsvcTransfer`; the service's HTTP
server plays an engine without weightsvc's backend, so a sync stops after the commit, at the engine."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import ServeProcess, serving
from tests.helpers import same_bits
from tests.integration.publish_rank import masters
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import FailedPrecondition, NotFound
from weightsvc.integrations.trl import WeightsvcSync, WeightsvcTransfer
from weightsvc.integrations.vllm.engine_api import EngineError
from weightsvc.rounding import ExportSpec

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from grpo_showcase import build  # noqa: E402

from tests.integration.test_trl_async import trainer  # noqa: E402

SPEC = ExportSpec("bf16", "sr", seed=0)  # `serve`'s defaults


@pytest.fixture(scope="module")
def copier(nixl_installed: None) -> Iterator[ServeProcess]:
    srv = ServeProcess("--nixl")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("trl-publish") / "model")


def pushed_as_masters(target: str, model: str, steps: dict[int, dict[str, torch.Tensor]]
                      ) -> dict[int, dict[str, torch.Tensor]]:
    """The service's own export of the same masters: pushed as fp32, in order, to `model`, pulled back."""
    with LearnerClient(target) as learner, InferenceClient(target) as client:
        out = {}
        for step, m in steps.items():
            learner.push(step, m, model)
            out[step] = client.pull(model, step)
        return out


def assert_same_version(target: str, model: str, other: str, version: int) -> None:
    """The two models' versions: the same served bytes, checksums and master digest."""
    with InferenceClient(target) as client:
        same_bits(client.pull(model, version), client.pull(other, version))
        a, b = client.manifest(model, version), client.manifest(other, version)
    assert {t.name: t.checksum for t in a.tensors} == {t.name: t.checksum for t in b.tensors}
    assert (a.master_digest, a.format, a.rounding, a.seed) == (b.master_digest, b.format, b.rounding, b.seed)


def test_a_transfer_sync_publishes_the_copy_the_loss_runs_on_bit_for_bit_the_services_export(
        copier: ServeProcess, model_dir: Path, tmp_path: Path) -> None:
    model = "trl-publish"
    transfer = WeightsvcTransfer(copier.target, copier.url, model=model, timeout_s=60, publish=True, spec=SPEC)
    t = trainer(model_dir, tmp_path, transfer, copier.url, token_budget=0)
    transfer.attach(t)
    module = t.accelerator.unwrap_model(t.model)
    with torch.no_grad():  # off the bf16 grid, as after an optimizer step: the rounding decides the bits
        gen = torch.Generator().manual_seed(1)
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    state = {n: v.detach().clone() for n, v in module.state_dict().items()}
    with pytest.raises(EngineError) as raised:  # (the engine plays one without the backend: after the commit)
        transfer.send_weights(iter(module.state_dict().items()))  # TRL's sync at global step 0
    assert raised.value.stage == "stage" and raised.value.status == 404
    assert (transfer.version, transfer.served_from, list(transfer.lag)) == (0, "published", [0])

    with InferenceClient(copier.target) as client:
        committed = client.pull(model, 0)
    same_bits(transfer.sync.served, committed)  # the learner's copy is the committed bytes
    pushed_as_masters(copier.target, f"{model}-pushed", {0: state})
    assert_same_version(copier.target, model, f"{model}-pushed", 0)
    # The loss's forward reads the published copy, not the masters.
    with transfer.sync.on_served_copy(module):
        read = {n: functools.reduce(getattr, n.split("."), module).detach().clone() for n in committed}
    for name, value in read.items():
        assert value.dtype == torch.float32 and torch.equal(value, committed[name].to(torch.float32)), name
    assert any(not torch.equal(read[n], state[n]) for n in read)


def test_a_sync_reads_the_spec_from_the_models_latest_version_and_publishes_each_step(copier: ServeProcess) -> None:
    model = "sync-discovers"
    steps = {v: masters(seed=v) for v in range(3)}
    with LearnerClient(copier.target) as learner:
        learner.push(0, steps[0], model)  # a version whose manifest says the service's spec
    sync = WeightsvcSync(copier.target, copier.url, model=model, timeout_s=60, publish=True)
    for version in (1, 2):
        sync.push(steps[version], version)
        assert (sync.version, sync.served_from) == (version, "published")
        with InferenceClient(copier.target) as client:
            same_bits(sync.served, client.pull(model, version))
    assert sync.spec == SPEC
    pushed_as_masters(copier.target, f"{model}-pushed", steps)
    for version in (1, 2):
        assert_same_version(copier.target, model, f"{model}-pushed", version)
    # The lag the learner measured is the one a push of the same run (from version 1) gets.
    pushed_as_masters(copier.target, f"{model}-lag", {v: steps[v] for v in (1, 2)})
    with InferenceClient(copier.target) as client:
        listed = {v.version: v.lag for v in client.versions(model) if v.version}
        pushed = {v.version: v.lag for v in client.versions(f"{model}-lag")}
    assert sync.lag == listed == pushed and all(v is not None for v in listed.values())
    sync.close()


def test_under_ef_the_learners_residual_makes_the_services_versions(nixl_installed: None) -> None:
    """`ef`'s served bits carry the residual of the versions before: the learner's, advanced once per
    publish that commits, gives each version the service's push of the same masters makes with its own."""
    steps = {v: masters(seed=v) for v in range(3)}
    srv = ServeProcess("--nixl", "--rounding", "ef")
    try:
        sync = WeightsvcSync(srv.target, srv.url, model="ef", timeout_s=60, publish=True,
                             spec=ExportSpec("bf16", "ef", seed=1))
        with pytest.raises(FailedPrecondition, match=r"seed 1 \(the server's: 0\)"):
            sync.push(steps[0], 0)  # refused: the residual it advanced is not kept
        assert sync.residual is None
        sync.spec = ExportSpec("bf16", "ef", seed=0)
        for version, m in steps.items():
            sync.push(m, version)
        assert sync.residual is not None and sync.residual.version == 2
        pushed_as_masters(srv.target, "ef-pushed", steps)
        for version in steps:
            assert_same_version(srv.target, "ef", "ef-pushed", version)
        sync.close()
    finally:
        srv.stop()


def test_a_spec_not_the_servers_is_refused_naming_model_version_and_both_specs(copier: ServeProcess) -> None:
    sync = WeightsvcSync(copier.target, copier.url, model="wrong-spec", timeout_s=60, publish=True,
                         spec=ExportSpec("bf16", "rtn", seed=0))
    with pytest.raises(FailedPrecondition) as refused:
        sync.push(masters(), 1)
    message = str(refused.value)
    assert message.startswith("model 'wrong-spec' version 1: the service did not commit the served copy the learner "
                              "published (bf16 rtn seed 0, as given (spec=))"), message
    assert "rounding 'rtn' (the server's: 'sr')" in message
    assert sync.version is None and sync.served == {}
    with InferenceClient(copier.target) as client, pytest.raises(NotFound):
        client.versions("wrong-spec")


def test_a_server_without_nixl_is_named_with_model_and_version(nixl_installed: None) -> None:
    with serving() as srv:
        sync = WeightsvcSync(srv.grpc_target, srv.http_url, model="no-nixl", timeout_s=60, publish=True, spec=SPEC)
        with pytest.raises(FailedPrecondition, match=r"^model 'no-nixl' version 4: .*without --nixl"):
            sync.push(masters(), 4)
        sync.close()


def test_a_spec_that_cannot_be_known_is_refused_before_anything_moves(copier: ServeProcess) -> None:
    sync = WeightsvcSync(copier.target, copier.url, model="no-spec", timeout_s=60, publish=True)
    with pytest.raises(ValueError, match=r"^model 'no-spec' version 0: publishing needs the service's export spec, "
                                         r"and the service holds no version of the model"):
        sync.push(masters(), 0)
    # A push's overrides cannot apply to a published copy: refused as the transfer is made.
    with pytest.raises(ValueError, match=r"model 'no-spec': publish commits the copy only in the service's own "
                                         r"export, which rounding='sr' would override"):
        WeightsvcTransfer(copier.target, copier.url, model="no-spec", rounding="sr", publish=True)
