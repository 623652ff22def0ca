"""Loading served copies into inference engines, against a live server.

vLLM and SGLang cannot run here: their engine objects are stood in for by small fakes that keep
their real contracts (vLLM's `collective_rpc` over tensor-parallel workers whose `load_weights`
fuses q/k/v and slices rows per rank; SGLang's `update_weights_from_tensor(named_tensors=...)`).
The helpers under test are the real ones, and the example worker runs as a user would run it.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from weightsvc import InferenceClient, LearnerClient
from weightsvc.loaders import VllmWorkerExtension, dequantize, load_into, update_module, update_sglang, update_vllm
from weightsvc.server.server import BackgroundServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inference_worker.py"


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


class Attention(torch.nn.Module):
    """Checkpoint layout: separate q/k/v projections, as a learner holds them."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(dim, dim, bias=False)
        self.k_proj = torch.nn.Linear(dim, dim, bias=False)
        self.v_proj = torch.nn.Linear(dim, dim, bias=False)
        self.norm = torch.nn.LayerNorm(dim)


def masters(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: p.detach().clone() for n, p in Attention().state_dict().items()}


def acked(server: BackgroundServer, model: str) -> dict[str, int]:
    return {c.client_id: c.version for c in server.service.clients(model)}


@pytest.mark.parametrize("format", ["bf16", "fp8_e4m3"])
def test_update_module_loads_the_served_copy_into_a_torch_module(
    server: BackgroundServer, learner: LearnerClient, model: str, format: str
) -> None:
    learner.push(7, masters(), model=model, format=format)
    module = Attention().to(torch.bfloat16)
    assert update_module(module, server.grpc_target, model, client_id="hf-0") == 7
    served = InferenceClient(server.grpc_target).pull(model, 7)
    expected = {n: v.to(torch.bfloat16) for n, v in dequantize(served).items()}
    assert sorted(expected) == sorted(module.state_dict())  # the scales are not module entries
    for name, value in module.state_dict().items():
        assert np.array_equal(bits(value), bits(expected[name])), name
    if format == "fp8_e4m3":
        assert served["q_proj.weight"].dtype == torch.float8_e4m3fn and "q_proj.weight_scale_inv" in served
    assert acked(server, model) == {"hf-0": 7}


def test_load_into_names_what_does_not_match(server: BackgroundServer, learner: LearnerClient, model: str) -> None:
    learner.push(1, masters(), model=model)
    served = InferenceClient(server.grpc_target).pull(model)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"extra.weight\""):
        load_into(torch.nn.ModuleDict({"extra": torch.nn.Linear(2, 2)}), {**served})
    result = load_into(torch.nn.ModuleDict({"q_proj": torch.nn.Linear(64, 64, bias=False)}), served, strict=False)
    assert "k_proj.weight" in result.unexpected_keys


class FakeVllmModel(torch.nn.Module):
    """vLLM's layout for tensor-parallel rank `rank` of `tp`: q/k/v fused into `qkv_proj`, each
    rank holding its rows; `load_weights` maps checkpoint names as vLLM's models do."""

    stacked = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2))

    def __init__(self, rank: int, tp: int, dim: int = 64) -> None:
        super().__init__()
        self.rank, self.rows = rank, dim // tp
        self.qkv_proj = torch.nn.Parameter(torch.zeros(3 * self.rows, dim, dtype=torch.bfloat16))
        self.norm = torch.nn.LayerNorm(dim, dtype=torch.bfloat16)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            for fused, part, shard in self.stacked:
                if name.startswith(part + "."):
                    rows = tensor[self.rank * self.rows : (self.rank + 1) * self.rows]
                    params[fused + ".weight" if fused + ".weight" in params else fused].data[
                        shard * self.rows : (shard + 1) * self.rows
                    ].copy_(rows)
                    loaded.add(fused)
                    break
            else:
                params[name].data.copy_(tensor)
                loaded.add(name)
        return loaded


class FakeVllmWorker(VllmWorkerExtension):
    def __init__(self, rank: int, tp: int) -> None:
        self.model_runner = type("ModelRunner", (), {"model": FakeVllmModel(rank, tp)})()


class FakeLLM:
    """`vllm.LLM` as `update_vllm` uses it: `collective_rpc` runs a method on every worker."""

    def __init__(self, tp: int) -> None:
        self.workers = [FakeVllmWorker(r, tp) for r in range(tp)]
        self.prefix_cache_resets = 0

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        threads_out: list[Any] = [None] * len(self.workers)

        def run(i: int) -> None:
            threads_out[i] = getattr(self.workers[i], method)(*args)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return threads_out

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True


def test_update_vllm_loads_every_tensor_parallel_worker_with_one_version(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    learner.push(3, masters(), model=model)
    llm = FakeLLM(tp=2)
    assert update_vllm(llm, server.grpc_target, model, client_id="vllm-0") == 3
    served = InferenceClient(server.grpc_target).pull(model, 3)
    for rank, worker in enumerate(llm.workers):
        m = worker.model_runner.model
        rows = slice(rank * m.rows, (rank + 1) * m.rows)
        expected = torch.cat([served[f"{p}_proj.weight"][rows] for p in "qkv"])
        assert np.array_equal(bits(m.qkv_proj), bits(expected))
        assert np.array_equal(bits(m.norm.weight), bits(served["norm.weight"]))
    assert llm.prefix_cache_resets == 1
    assert acked(server, model) == {"vllm-0": 3}


class FakeSglangEngine:
    """`sglang.Engine.update_weights_from_tensor` over a module in checkpoint layout."""

    def __init__(self) -> None:
        self.module = Attention().to(torch.bfloat16)
        self.flushed = False

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
        self.flushed = flush_cache
        return True, "Succeeded to update model weights."


def test_update_sglang_hands_the_engine_checkpoint_named_tensors(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    learner.push(2, masters(), model=model)
    learner.push(5, masters(1), model=model)
    engine = FakeSglangEngine()
    assert update_sglang(engine, server.grpc_target, model, 2, client_id="sglang-0") == 2
    served = InferenceClient(server.grpc_target).pull(model, 2)
    for name, value in engine.module.state_dict().items():
        assert np.array_equal(bits(value), bits(served[name])), name
    assert engine.flushed
    assert acked(server, model) == {"sglang-0": 2}


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("inference_worker", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_worker_follows_each_version_while_it_samples(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    example = _example()
    torch.manual_seed(0)
    state = {n: p.detach().clone() for n, p in example.Policy().state_dict().items()}
    learner.push(1, state, model=model, rounding="sr-sticky")
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--target", server.grpc_target, "--model", model, "--until-version", "4"],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        events = [json.loads(lines.get(timeout=120))]
        for step in (2, 3, 4):  # each version pushed once the worker runs the previous one
            assert (events[-1]["event"], events[-1]["version"]) == ("swap", step - 1)
            state["head.weight"] += 1e-2 * torch.randn_like(state["head.weight"])  # the rest stays put
            learner.push(step, state, model=model, rounding="sr-sticky")
            events.append(json.loads(lines.get(timeout=120)))
        done = json.loads(lines.get(timeout=120))
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert [e["version"] for e in events] == [1, 2, 3, 4]
    # Only the head changed: the worker pulled deltas after its first, dense, pull.
    assert all(e["pulled_bytes"] < events[0]["pulled_bytes"] / 2 for e in events[1:])
    assert done["version"] == 4
    assert done["digest"] == example.weights_digest(InferenceClient(server.grpc_target).pull(model, 4))
    assert all(done["steps"].get(str(v), 0) > 0 for v in (1, 2, 3))  # sampled with every version it held
    assert list(acked(server, model).values()) == [4]
