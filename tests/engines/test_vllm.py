"""A real vLLM (CPU) follows weightsvc: each update gives, token for token, what a fresh engine
started from the pulled served copy gives. Run alone with `scripts/test_engines.sh`."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import serving
from tests.engines.engines import (
    LINEARS,
    checkpoint,
    engine,
    generate,
    masters,
    quantized_checkpoint,
    served_checkpoint,
    step,
)
from tests.helpers import bits
from weightsvc import InferenceClient, LearnerClient
from weightsvc.loaders import Mismatch, compressed_tensors_config, dequantize, tp_select, update_vllm
from weightsvc.server.server import BackgroundServer

pytestmark = pytest.mark.engine
CPU_EMULATION = "weightsvc.loaders.VllmCpuEmulationExtension"  # vLLM's MXFP8 and NVFP4 kernels on the CPU
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inference_worker.py"


def acked(server: BackgroundServer, model: str) -> dict[str, int]:
    return {c.client_id: c.version for c in server.service.clients(model)}


# An engine start (two processes spawned, each importing vLLM) is most of what these tests take. The
# tests that load versions into a bf16 engine in place share one per model shape, for as long as
# their class runs: each pushes its own versions, loads them, and compares with a fresh engine
# started from what it loaded, so none depends on what another left in the engine. The fresh
# engines stay per test: they are the reference.


@pytest.fixture(scope="class")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    """A bf16 Llama engine (head untied) started from `masters("llama")`: its checkpoint and the engine."""
    start = checkpoint(masters("llama")[0], tmp_path_factory.mktemp("llama") / "v0")
    with engine(start, in_process=False) as llm:  # up while the tests' fresh engines start here
        yield start, llm


@pytest.fixture(scope="class")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    """A bf16 Qwen2 engine (head tied to the embeddings) started from `masters("qwen2")`."""
    start = checkpoint(masters("qwen2")[0], tmp_path_factory.mktemp("qwen2") / "v0")
    with engine(start, in_process=False) as llm:  # up while the tests' fresh engines start here
        yield start, llm


class TestLlamaInPlace:
    """Versions loaded in place into one bf16 Llama engine (head untied)."""

    def test_untied_llama_follows_two_versions_in_a_row(self, server: BackgroundServer, learner: LearnerClient,
                                                        tmp_path: Path, llama: tuple[Path, Any]) -> None:
        start, llm = llama
        module, _ = masters("llama")  # the masters the engine started from
        before = generate(llm)
        for version in (1, 2):
            learner.push(version, step(module, version), model="llama")
            assert update_vllm(llm, server.grpc_target, "llama", client_id="vllm-0") == version
            got = generate(llm)
            assert acked(server, "llama") == {"vllm-0": version}
            served = served_checkpoint(start, server.grpc_target, "llama", version, tmp_path / f"v{version}")
            with engine(served) as fresh:
                assert got == generate(fresh)
            assert [g[0] for g in got] != [b[0] for b in before]  # the update did change the policy
            before = got

    def test_an_fp8_version_loads_dequantized_into_a_bf16_engine(self, server: BackgroundServer, learner: LearnerClient,
                                                                 tmp_path: Path, llama: tuple[Path, Any]) -> None:
        # vLLM's CPU backend runs block-scaled fp8 only on CPUs with AMX tiles ("CPUFp8BlockScaledMMKernel
        # requires AMX tile support (Sapphire Rapids or newer)"): here fp8 versions load as values.
        start, llm = llama
        module, _ = masters("llama", seed=13)
        learner.push(1, step(module, 1), model="llama-fp8", format="fp8_e4m3")
        before = generate(llm)
        with pytest.raises(Mismatch, match=r"is served as F8_E4M3; the engine runs BF16"):
            update_vllm(llm, server.grpc_target, "llama-fp8", client_id="fp8")
        assert generate(llm) == before and acked(server, "llama-fp8") == {}
        update_vllm(llm, server.grpc_target, "llama-fp8", client_id="fp8", dequantize=True)
        got = generate(llm)
        values = dequantize(InferenceClient(server.grpc_target).pull("llama-fp8", 1))
        reference = served_checkpoint(start, server.grpc_target, "llama-fp8", 1, tmp_path / "v1")
        save_file({n: t.to(torch.bfloat16) for n, t in values.items()}, str(reference / "model.safetensors"))
        with engine(reference) as fresh:
            assert got == generate(fresh)
        assert acked(server, "llama-fp8") == {"fp8": 1}


class TestTiedQwen2InPlace:
    """Versions loaded in place into one bf16 Qwen2 engine (head tied to the embeddings)."""

    def test_tied_model_travels_once_and_its_head_follows(self, server: BackgroundServer, learner: LearnerClient,
                                                          tmp_path: Path, qwen2: tuple[Path, Any]) -> None:
        start, llm = qwen2
        module, _ = masters("qwen2")
        state = step(module, 1)
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        info = learner.push(1, state, model="qwen2")
        with InferenceClient(server.grpc_target) as client:
            manifest = client.manifest("qwen2", 1)
            served = client.pull("qwen2", 1)
        assert manifest.aliases == (("lm_head.weight", "model.embed_tokens.weight"),)
        assert "lm_head.weight" not in {t.name for t in manifest.tensors}
        assert info.data_bytes == sum(v.numel() * 2 for n, v in state.items() if n != "lm_head.weight")
        assert np.array_equal(bits(served["lm_head.weight"]), bits(served["model.embed_tokens.weight"]))
        before = generate(llm)
        update_vllm(llm, server.grpc_target, "qwen2", client_id="vllm-tied")
        got = generate(llm)
        with engine(served_checkpoint(start, server.grpc_target, "qwen2", 1, tmp_path / "v1")) as fresh:
            assert got == generate(fresh)
        assert [g[0] for g in got] != [b[0] for b in before]

        # A version that does not fit the engine is refused before anything is written: the engine
        # keeps generating what it did, and nothing is acked.
        other, _ = masters("llama")
        learner.push(1, other.state_dict(), model="other-shape")
        with pytest.raises(Mismatch, match=r"tensor 'lm_head.weight' \(shape \[512, 128\]\) is not in the engine's"):
            update_vllm(llm, server.grpc_target, "other-shape", client_id="vllm-tied")
        assert generate(llm) == got
        assert acked(server, "other-shape") == {}

    def test_a_checkpoint_without_the_tied_head_loads_into_a_tied_engine(
        self, server: BackgroundServer, learner: LearnerClient, tmp_path: Path, qwen2: tuple[Path, Any]
    ) -> None:
        start, llm = qwen2
        module, _ = masters("qwen2", seed=3)
        state = {n: v for n, v in step(module, 7).items() if n != "lm_head.weight"}  # as save_pretrained writes it
        learner.push(5, state, model="qwen2-file")
        assert update_vllm(llm, server.grpc_target, "qwen2-file", client_id="w") == 5
        got = generate(llm)
        with engine(served_checkpoint(start, server.grpc_target, "qwen2-file", 5, tmp_path / "v5")) as fresh:
            assert got == generate(fresh)


def test_tensor_parallel_workers_pull_their_slices(server: BackgroundServer, learner: LearnerClient, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker (this machine has 2)
    module, _ = masters("llama", seed=11)
    start = checkpoint(module, tmp_path / "v0")
    learner.push(1, step(module, 1), model="llama-tp")
    with engine(start, tp=2) as llm:
        results = llm.collective_rpc("weightsvc_load", args=(server.grpc_target, "llama-tp", 1, False))
        llm.reset_prefix_cache()
        got = generate(llm)
        with engine(served_checkpoint(start, server.grpc_target, "llama-tp", 1, tmp_path / "v1"), tp=2) as fresh:
            assert got == generate(fresh)
    manifest = InferenceClient(server.grpc_target).manifest("llama-tp", 1)
    select = tp_select(manifest, 0, 2, num_kv_heads=2, head_dim=32)
    sliced = sum(t.nbytes for t in manifest.tensors if select[t.name] is not None)
    whole = manifest.data_bytes - sliced
    for r in results:
        assert r["pulled_bytes"] <= whole + sliced / 2 + 64 * 1024  # framing aside, half of every sliced tensor
    assert sorted(r["rank"] for r in results) == [0, 1]


def test_example_worker_drives_a_real_engine(server: BackgroundServer, learner: LearnerClient, tmp_path: Path) -> None:
    module, _ = masters("llama", seed=5)
    start = checkpoint(module, tmp_path / "v0")
    learner.push(1, step(module, 1), model="llama-worker")
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--target", server.grpc_target, "--model", "llama-worker",
         "--until-version", "2", "--vllm", str(start)],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # its engine in its own process: a start of seconds
    )
    lines: queue.Queue[str] = queue.Queue()  # the worker's events (vLLM logs to stdout too)
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout if line.startswith('{"event"')],  # type: ignore[union-attr]
                     daemon=True).start()
    try:
        first = json.loads(lines.get(timeout=300))
        assert (first["event"], first["version"]) == ("swap", 1)
        learner.push(2, step(module, 2), model="llama-worker")
        second = json.loads(lines.get(timeout=300))
        done = json.loads(lines.get(timeout=300))
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert (second["event"], second["version"]) == ("swap", 2)
    assert done["version"] == 2 and done["tokens"] > 0  # it sampled while it followed
    assert acked(server, "llama-worker") and set(acked(server, "llama-worker").values()) == {2}
    with engine(served_checkpoint(start, server.grpc_target, "llama-worker", 2, tmp_path / "v2")) as fresh:
        assert done["generations"] == [g[0] for g in generate(fresh)]


def test_an_engine_that_dies_during_an_update_is_reported_and_not_acked(
    server: BackgroundServer, learner: LearnerClient, tmp_path: Path
) -> None:
    module, _ = masters("llama", seed=17)
    start = checkpoint(module, tmp_path / "v0")
    learner.push(1, step(module, 1), model="llama-dies")
    died = r"model 'llama-dies' version 1: the vLLM engine died during the update"
    with engine(start, in_process=False, worker_extension_cls="tests.engines.dying.DyingWorkerExtension") as llm, \
            pytest.raises(RuntimeError, match=died):
        update_vllm(llm, server.grpc_target, "llama-dies", client_id="dies")
    assert acked(server, "llama-dies") == {}


def test_an_mxfp8_engine_loads_mxfp8_versions_as_they_are_served(tmp_path: Path) -> None:
    # The engine runs compressed-tensors' MXFP8 (e4m3 elements, a UE8M0 scale per 32) on the CPU through
    # vLLM's emulation kernel; the version, rounded stochastically, replaces its weights in place.
    module, _ = masters("llama", seed=19)
    start = quantized_checkpoint(module, tmp_path / "v0", "mxfp8")
    with serving(format="mxfp8", rounding="sr", fp8_pattern=LINEARS) as server, \
            LearnerClient(server.grpc_target) as learner:
        learner.push(1, step(module, 1), model="llama-mxfp8")
        with engine(start, worker_extension_cls=CPU_EMULATION) as llm:
            before = generate(llm)
            assert update_vllm(llm, server.grpc_target, "llama-mxfp8", client_id="mx") == 1
            got = generate(llm)
        assert acked(server, "llama-mxfp8") == {"mx": 1}
        served = served_checkpoint(start, server.grpc_target, "llama-mxfp8", 1, tmp_path / "v1",
                                   quantization=compressed_tensors_config("mxfp8"))
    with engine(served, worker_extension_cls=CPU_EMULATION) as fresh:
        assert got == generate(fresh)
    assert [g[0] for g in got] != [b[0] for b in before]


def test_an_nvfp4_engine_loads_nvfp4_versions_in_place(tmp_path: Path) -> None:
    # On the CPU vLLM runs NVFP4 only as W4A4 (its emulation kernel quantizes each layer's input too,
    # under the checkpoint's input_global_scale, which every reload keeps). One engine, started from
    # version 1's served copy, loads version 2 and then version 1 again in place: what it generates
    # then is what it generated fresh.
    module, _ = masters("llama", seed=23)
    start = quantized_checkpoint(module, tmp_path / "v0", "nvfp4")
    with serving(format="nvfp4", rounding="sr", fp8_pattern=LINEARS) as server, \
            LearnerClient(server.grpc_target) as learner:
        for version in (1, 2):
            learner.push(version, step(module, version), model="llama-nvfp4")
        v1 = served_checkpoint(start, server.grpc_target, "llama-nvfp4", 1, tmp_path / "v1",
                               quantization=compressed_tensors_config("nvfp4"))
        with engine(v1, worker_extension_cls=CPU_EMULATION) as llm:
            fresh = generate(llm)
            assert update_vllm(llm, server.grpc_target, "llama-nvfp4", 2, client_id="nv") == 2
            other = generate(llm)
            assert update_vllm(llm, server.grpc_target, "llama-nvfp4", 1, client_id="nv") == 1
            again = generate(llm)
    assert again == fresh
    assert [g[0] for g in other] != [f[0] for f in fresh]  # version 2 did change the policy
