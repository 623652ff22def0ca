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
import re
import subprocess
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import bits
from weightsvc import InferenceClient, LearnerClient
from weightsvc.loaders import (
    Mismatch,
    VllmWorkerExtension,
    check_engine_fits,
    dequantize,
    load_into,
    update_module,
    update_sglang,
    update_vllm,
)
from weightsvc.protocol.names import PUSH
from weightsvc.protocol.wire import encode_message
from weightsvc.rounding import ExportSpec, export_state_dict
from weightsvc.server.server import BackgroundServer
from weightsvc.v1 import weightsvc_pb2 as pb

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inference_worker.py"


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
    with pytest.raises(Mismatch, match=r"missing 'extra.weight' \(shape \[2, 2\]\)"):
        load_into(torch.nn.ModuleDict({"extra": torch.nn.Linear(2, 2)}), {**served})
    result = load_into(torch.nn.ModuleDict({"q_proj": torch.nn.Linear(64, 64, bias=False)}), served, strict=False)
    assert "k_proj.weight" in result.unexpected_keys


class TiedLM(torch.nn.Module):
    """A language model whose output head is tied to its embeddings, as HF's `tie_word_embeddings`."""

    def __init__(self, vocab: int = 96, dim: int = 64) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("format", ["bf16", "fp8_e4m3"])
def test_tied_weights_travel_once_and_are_served_under_both_names(
    server: BackgroundServer, learner: LearnerClient, model: str, format: str
) -> None:
    torch.manual_seed(0)
    state = TiedLM().state_dict()
    info = learner.push(1, state, model=model, format=format)
    with InferenceClient(server.grpc_target) as client:
        manifest = client.manifest(model, 1)
        served = client.pull(model, 1)
        http = InferenceClient(server.http_url).pull(model, 1)
    assert manifest.aliases == (("lm_head.weight", "embed_tokens.weight"),)
    assert [t.name for t in manifest.tensors if t.name.startswith(("lm_head", "embed"))] == ["embed_tokens.weight"]
    proj = 64 * 64 + 4 if format == "fp8_e4m3" else 64 * 64 * 2  # (fp8: one byte, and one block scale)
    assert info.data_bytes == 96 * 64 * 2 + proj
    for pulled in (served, http):
        assert pulled["lm_head.weight"] is pulled["embed_tokens.weight"]
        assert pulled["lm_head.weight"].dtype == torch.bfloat16  # tied to the embeddings: never fp8
    tied = TiedLM().to(torch.bfloat16)
    update_module(tied, server.grpc_target, model, client_id="tied")
    assert np.array_equal(bits(tied.lm_head.weight), bits(served["embed_tokens.weight"]))


def test_a_declared_tie_pushes_the_tensor_under_its_own_name(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    torch.manual_seed(0)
    head = torch.randn(96, 64)
    learner.push(1, {"lm_head.weight": head}, model=model, tied={"lm_head.weight": "embed_tokens.weight"})
    served = InferenceClient(server.grpc_target).pull(model, 1)
    assert sorted(served) == ["embed_tokens.weight", "lm_head.weight"]
    assert served["lm_head.weight"] is served["embed_tokens.weight"]
    assert torch.allclose(served["lm_head.weight"].float(), head, rtol=1e-2)
    with pytest.raises(ValueError, match=r"'lm_head.weight' and 'embed_tokens.weight' are declared tied but"):
        learner.push(2, {"lm_head.weight": head, "embed_tokens.weight": head + 1}, model=model,
                     tied={"lm_head.weight": "embed_tokens.weight"})


def test_the_service_refuses_aliases_that_name_no_tensor(server: BackgroundServer, model: str) -> None:
    learner = LearnerClient(server.grpc_target)
    bad = [({"lm_head.weight": "nothing"}, r"alias 'lm_head.weight' names tensor 'nothing', which the push does not"),
           ({"w": "w"}, r"alias 'w' \(of 'w'\) is also a tensor of the push")]
    for aliases, message in bad:
        header = pb.PushHeader(model=model, step=1, tensors=[pb.TensorSpec(name="w", shape=[2], dtype="F32")])
        header.aliases.update(aliases)
        reqs = [pb.PushRequest(header=header), pb.PushRequest(chunk=pb.Chunk(tensor="w", data=bytes(8))),
                pb.PushRequest(commit=pb.PushCommit())]
        push = learner._channel.stream_unary(PUSH, request_serializer=encode_message,
                                             response_deserializer=pb.PushResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            push(iter(reqs))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and re.search(message, e.value.details())
    assert model not in {m["model"] for m in InferenceClient(server.grpc_target).models()}


def test_a_checkpoint_without_the_tied_name_loads_into_a_tied_module(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    torch.manual_seed(0)
    state = {n: v for n, v in TiedLM().state_dict().items() if n != "lm_head.weight"}  # as save_pretrained writes
    learner.push(1, state, model=model)
    module = TiedLM()
    assert update_module(module, server.grpc_target, model, client_id="hf") == 1
    served = InferenceClient(server.grpc_target).pull(model, 1)
    assert torch.equal(module.lm_head.weight, served["embed_tokens.weight"].float())
    assert acked(server, model) == {"hf": 1}


def test_a_version_that_does_not_fit_writes_nothing_and_is_not_acked(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    torch.manual_seed(0)
    state = TiedLM().state_dict()
    state["proj.weight"] = torch.randn(64, 32)  # the module's is 64 x 64
    learner.push(1, state, model=model)
    module = TiedLM()
    before = {n: v.clone() for n, v in module.state_dict().items()}
    with pytest.raises(Mismatch, match=r"tensor 'proj.weight' has shape \[64, 32\]; the module expects \[64, 64\]"):
        update_module(module, server.grpc_target, model, client_id="hf")
    assert all(torch.equal(v, before[n]) for n, v in module.state_dict().items())  # not even the embeddings
    assert acked(server, model) == {}


def test_loaders_is_the_public_face_of_the_integrations() -> None:
    # The names users import from weightsvc.loaders, and the class paths they hand vLLM as
    # `worker_extension_cls` (resolved as vLLM does: import the module, take the attribute).
    from weightsvc.integrations.vllm.worker import VllmWorkerExtension as Extension

    loaders = importlib.import_module("weightsvc.loaders")
    assert all(getattr(loaders, name) is not None for name in loaders.__all__)
    assert loaders.VllmWorkerExtension is Extension
    if importlib.util.find_spec("vllm") is None:  # the CPU extension imports vLLM, in vLLM's workers only
        with pytest.raises(ModuleNotFoundError, match="vllm"):
            _ = loaders.VllmCpuEmulationExtension
    else:
        assert issubclass(loaders.VllmCpuEmulationExtension, Extension)
    with pytest.raises(AttributeError, match="has no attribute 'VllmOther'"):
        _ = loaders.VllmOther


# A Llama-shaped checkpoint: vocabulary, width, MLP width, attention heads, KV heads, layers.
LLAMA = SimpleNamespace(vocab_size=1000, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)


def llama_masters(layers: int = 2) -> dict[str, torch.Tensor]:
    c, gen = LLAMA, torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,),
              "lm_head.weight": (c.vocab_size, c.hidden_size)}
    kv, d, f = c.num_key_value_heads * c.head_dim, c.hidden_size, c.intermediate_size
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f),
                   p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def vllm_part(name: str, whole: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """The part of a whole checkpoint tensor that vLLM's layers keep on tensor-parallel rank `rank`,
    as their weight loaders narrow it: a padded share of the vocabulary, rows of the column-parallel
    layers (one KV head per group of ranks when there are fewer KV heads than ranks), columns of
    the row-parallel ones, every other tensor whole."""
    layer = name.rsplit(".", 2)[-2]
    if name.endswith("_global_scale"):  # NVFP4's: one per tensor, whole on every rank
        return whole
    if layer in ("embed_tokens", "lm_head"):
        per = -(-whole.shape[0] // 64) * 64 // tp
        return whole[rank * per : min((rank + 1) * per, whole.shape[0])]
    if layer in ("k_proj", "v_proj") and LLAMA.num_key_value_heads < tp:
        head = rank // (tp // LLAMA.num_key_value_heads)
        return whole[head * LLAMA.head_dim : (head + 1) * LLAMA.head_dim]
    if layer in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        rows = whole.shape[0] // tp
        return whole[rank * rows : (rank + 1) * rows]
    if layer in ("o_proj", "down_proj"):
        cols = whole.shape[1] // tp
        return whole[:, rank * cols : (rank + 1) * cols]
    return whole


class FakeVllmWorker(VllmWorkerExtension):
    """A tensor-parallel worker of vLLM as the extension sees it: its model config, its rank, and a
    model whose `load_weights` takes whole checkpoint tensors and keeps its rank's part of each
    (`vllm_part`). It has no `reload_weights`, as vLLM before in-place reload."""

    def __init__(self, rank: int, tp: int) -> None:
        self.rank, self.tp, self.kept = rank, tp, {}
        model = SimpleNamespace(load_weights=self._load_weights)
        self.model_runner = SimpleNamespace(model=model, model_config=SimpleNamespace(model="", hf_config=LLAMA,
                                                                                      dtype=torch.bfloat16))

    def _weightsvc_tp(self) -> tuple[int, int]:
        return self.rank, self.tp

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.kept = {name: vllm_part(name, t, self.rank, self.tp).clone() for name, t in weights}
        return set(self.kept)


class EngineDeadError(RuntimeError):
    """As vLLM's: what `collective_rpc` raises once the engine's process is gone."""


class FakeLLM:
    """`vllm.LLM` as `update_vllm` uses it: `collective_rpc` runs a method on every worker."""

    def __init__(self, tp: int, dies: bool = False) -> None:
        self.workers = [FakeVllmWorker(r, tp) for r in range(tp)]
        self.prefix_cache_resets = 0
        self.dies = dies

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = ()) -> list[Any]:
        if self.dies:
            raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        with ThreadPoolExecutor(len(self.workers)) as pool:  # a worker's error is raised here, as vLLM does
            return list(pool.map(lambda w: getattr(w, method)(*args), self.workers))

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True


@pytest.mark.parametrize("format", ["bf16", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_tensor_parallel_worker_pulls_only_its_slice(
    server: BackgroundServer, learner: LearnerClient, model: str, tp: int, format: str
) -> None:
    # Microscaled formats: packed elements and block scales are split as their weight (on block
    # boundaries: 128 and 256 columns split 4 ways are whole blocks), NVFP4's global scales whole.
    learner.push(3, llama_masters(), model=model, format=format)
    llm = FakeLLM(tp)
    assert update_vllm(llm, server.grpc_target, model, client_id="vllm-0") == 3
    whole = InferenceClient(server.grpc_target).pull(model, 3)
    for rank, worker in enumerate(llm.workers):
        assert sorted(worker.kept) == sorted(whole)
        for name, kept in worker.kept.items():
            assert np.array_equal(bits(kept), bits(vllm_part(name, whole[name], rank, tp))), (rank, name)
    assert llm.prefix_cache_resets == 1
    assert acked(server, model) == {"vllm-0": 3}
    # Bytes per worker: the replicated tensors whole, 1/TP of the others (KV heads replicated at TP 4).
    manifest = InferenceClient(server.grpc_target).manifest(model, 3)
    results = llm.collective_rpc("weightsvc_load", args=(server.grpc_target, model, 3, False))
    pulled = [r["pulled_bytes"] for r in results]
    parts = [sum(vllm_part(n, whole[n], r, tp).nbytes for n in whole) for r in range(tp)]
    for got, part in zip(pulled, parts, strict=True):
        assert part <= got <= part + 16 * 1024, (got, part)  # the tensors' bytes, and the manifest
    assert max(parts) <= manifest.data_bytes / tp * 1.1 + (tp > 2) * manifest.data_bytes * 0.1


@pytest.mark.parametrize("format", ["fp8_e4m3", "mxfp8", "nvfp4", "mxfp4"])
def test_tensor_parallel_workers_load_a_scaled_version_as_values(
    server: BackgroundServer, learner: LearnerClient, model: str, format: str
) -> None:
    learner.push(1, llama_masters(), model=model, format=format)
    llm = FakeLLM(2)
    update_vllm(llm, server.grpc_target, model, client_id="vllm-fp8", dequantize=True)
    served = InferenceClient(server.grpc_target).pull(model, 1)
    values = {n: t.to(torch.bfloat16) for n, t in dequantize(served).items()}
    for rank, worker in enumerate(llm.workers):
        assert sorted(worker.kept) == sorted(values)
        for name, kept in worker.kept.items():
            assert np.array_equal(bits(kept), bits(vllm_part(name, values[name], rank, 2))), (rank, name)


def engine_config(path: Path, checkpoint: dict[str, torch.Tensor]) -> SimpleNamespace:
    """The model config of a vLLM engine started from a directory holding `checkpoint`."""
    path.mkdir()
    save_file({n: t.contiguous() for n, t in checkpoint.items()}, str(path / "model.safetensors"))
    return SimpleNamespace(model=str(path), hf_config=LLAMA)


def test_a_microscaled_version_fits_an_engine_of_its_own_format_only(
    server: BackgroundServer, learner: LearnerClient, model: str, tmp_path: Path
) -> None:
    masters = llama_masters()
    for version, format in ((1, "mxfp8"), (2, "nvfp4")):
        learner.push(version, masters, model=model, format=format)
    mxfp8, nvfp4 = (InferenceClient(server.grpc_target).manifest(model, v) for v in (1, 2))

    def start(format: str) -> dict[str, torch.Tensor]:
        return export_state_dict(masters, ExportSpec(format, "rtn"), version=0)

    # An NVFP4 (W4A4) checkpoint also holds each layer's activation calibration, which no version does.
    calibration = {n.replace("weight_global_scale", "input_global_scale"): torch.ones(1)
                   for n in start("nvfp4") if n.endswith("weight_global_scale")}
    engines = {f: engine_config(tmp_path / f, start(f)) for f in ("bf16", "mxfp8")}
    engines["nvfp4"] = engine_config(tmp_path / "nvfp4", start("nvfp4") | calibration)
    check_engine_fits(mxfp8, engines["mxfp8"])  # e4m3 elements and uint8 scales, as the engine's
    check_engine_fits(nvfp4, engines["nvfp4"])
    with pytest.raises(Mismatch, match=r"model '.*' version 1: tensor 'lm_head.weight' is served "
                                       r"as F8_E4M3; the engine runs BF16 \(update with dequantize=True"):
        check_engine_fits(mxfp8, engines["bf16"])
    for manifest in (mxfp8, nvfp4):  # as values: the masters' names and shapes
        check_engine_fits(manifest, engines["bf16"], dequantize=True)
    # Codes and scales load bit for bit: the same shapes in another dtype do not fit.
    with pytest.raises(Mismatch, match=r"tensor '\S+\.weight_scale' is served as U8; the engine runs F8_E4M3$"):
        check_engine_fits(mxfp8, engines["nvfp4"])
    with pytest.raises(Mismatch, match=r"tensor '\S+\.weight_scale' is served as F8_E4M3; the engine runs U8$"):
        check_engine_fits(nvfp4, engines["mxfp8"])
    with pytest.raises(Mismatch, match=r"tensor 'lm_head\.weight_\w+' \(shape \[[\d, ]+\]\) is not in the engine's"):
        check_engine_fits(nvfp4, engines["bf16"])


def test_an_engine_that_dies_during_an_update_is_reported_and_not_acked(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    learner.push(1, llama_masters(), model=model)
    with pytest.raises(RuntimeError, match=rf"model '{model}' version 1: the vLLM engine died during the update"):
        update_vllm(FakeLLM(2, dies=True), server.grpc_target, model, client_id="vllm-dead")
    live = FakeLLM(2)
    def no_room(weights: object) -> None:
        raise MemoryError("no room for the weights")

    live.workers[1].model_runner.model.load_weights = no_room
    with pytest.raises(MemoryError, match="no room for the weights"):  # a live engine's own error, as it is
        update_vllm(live, server.grpc_target, model, client_id="vllm-live")
    assert acked(server, model) == {}


class FakeSglangEngine:
    """`sglang.Engine` (0.5.23) as `update_sglang` uses it, over a module in checkpoint layout, with
    a tied head as SGLang's Qwen2 keeps it: `update_weights_from_tensor(named_tensors, load_format=None,
    flush_cache=True)` answers `(success, message)`, refuses outside a `begin_weight_update()` /
    `end_weight_update()` session, and warns of (and skips) a name the model does not have."""

    def __init__(self, refuse: bool = False) -> None:
        self.module = TiedLM().to(torch.bfloat16)
        self.flushed = self.in_session = False
        self.refuse = refuse
        self.skipped: list[str] = []

    def begin_weight_update(self, selector: str = "all") -> None:
        self.in_session = True

    def end_weight_update(self) -> None:
        self.in_session = False

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        if not self.in_session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if self.refuse:
            return False, "Failed to update weights: out of memory"
        params = dict(self.module.named_parameters())  # the tied head is not among them
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in params:
                    params[name].copy_(tensor)
                else:
                    self.skipped.append(name)
        self.flushed = flush_cache
        return True, "Success"


def test_update_sglang_hands_the_engine_checkpoint_named_tensors(
    server: BackgroundServer, learner: LearnerClient, model: str
) -> None:
    torch.manual_seed(0)
    learner.push(2, TiedLM().state_dict(), model=model)
    learner.push(5, TiedLM().state_dict(), model=model)
    engine = FakeSglangEngine()
    assert update_sglang(engine, server.grpc_target, model, 2, client_id="sglang-0") == 2
    served = InferenceClient(server.grpc_target).pull(model, 2)
    for name, value in engine.module.state_dict().items():
        assert np.array_equal(bits(value), bits(served[name])), name
    assert engine.flushed and not engine.in_session and engine.skipped == ["lm_head.weight"]
    assert acked(server, model) == {"sglang-0": 2}
    with pytest.raises(RuntimeError, match=r"version 5: SGLang refused the update: Failed to update weights"):
        update_sglang(FakeSglangEngine(refuse=True), server.grpc_target, model, client_id="sglang-1")
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
