"""`WeightsvcTransfer` set up wrong gets a clear error before anything moves: a real `AsyncGRPOTrainer` (on
the CPU, its GPU-only parts stood in for by examples/async_grpo_cpu.py) and a real weightsvc service,
whose HTTP server plays an engine without weightsvc's backend (it answers the RL routes 404)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import serving
from weightsvc import InferenceClient
from weightsvc.errors import NotFound
from weightsvc.integrations.trl import WeightsvcTransfer
from weightsvc.integrations.vllm.engine_api import EngineError
from weightsvc.server.server import BackgroundServer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from async_grpo_cpu import without_mfu  # noqa: E402
from grpo_showcase import build, even_tokens  # noqa: E402


@pytest.fixture(scope="module")
def service() -> Iterator[BackgroundServer]:
    with serving(rounding="sr") as srv:
        yield srv


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("trl") / "model")


def trainer(model_dir: Path, tmp_path: Path, transfer: Any, engine: str, **config: Any) -> Any:
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    without_mfu()
    prompts = Dataset.from_dict({"prompt": ["t1 t4 t5 t6"] * 8})
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=8,
                           report_to="none", use_cpu=True, bf16=False, vllm_server_base_url=engine, **config)
    rollouts = transfer.rollouts(prompts, even_tokens) if isinstance(transfer, WeightsvcTransfer) else None
    return AsyncGRPOTrainer(model=str(model_dir), reward_funcs=even_tokens, args=args, train_dataset=prompts,
                            weight_transfer=transfer, rollout_worker=rollouts)


def test_an_engine_without_weightsvcs_backend_is_named_before_the_first_push(
        service: BackgroundServer, model_dir: Path, tmp_path: Path) -> None:
    transfer = WeightsvcTransfer(service.grpc_target, service.http_url, model="trl-no-backend", timeout_s=10)
    with pytest.raises(RuntimeError, match=r"call WeightsvcTransfer.attach\(trainer\)"):
        transfer.init_weight_transfer()  # (what TRL calls first, at train begin)
    transfer.attach(trainer(model_dir, tmp_path, transfer, service.http_url, token_budget=0))
    with pytest.raises(EngineError) as raised:
        transfer.init_weight_transfer()
    assert raised.value.stage == "connect" and raised.value.status == 404
    assert service.http_url in str(raised.value) and '{"backend": "weightsvc"}' in str(raised.value)
    with InferenceClient(service.grpc_target) as client, pytest.raises(NotFound):
        client.versions("trl-no-backend")  # nothing was pushed


def test_attach_refuses_a_trainer_it_cannot_serve(service: BackgroundServer, model_dir: Path, tmp_path: Path) -> None:
    transfer = WeightsvcTransfer(service.grpc_target, "http://127.0.0.1:9", model="trl-attach")
    # A trainer built with another weight transfer: its syncs would never reach this one.
    other = WeightsvcTransfer(service.grpc_target, "http://127.0.0.1:9", model="trl-attach")
    with pytest.raises(ValueError, match="not built with this WeightsvcTransfer"):
        transfer.attach(trainer(model_dir, tmp_path / "a", other, "http://127.0.0.1:9", token_budget=0))
    # A trainer that would ask another server for max_model_len than the engine the transfer drives.
    with pytest.raises(ValueError, match=re.escape("vllm_server_base_url is http://127.0.0.1:8000, not the engine")):
        transfer.attach(trainer(model_dir, tmp_path / "b", transfer, "http://127.0.0.1:8000"))
