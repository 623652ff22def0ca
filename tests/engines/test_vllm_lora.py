"""LoRA adapter versions in a real `vllm serve` (`--enable-lora`): `weightsvc follow --max-live N`
loads each version of an adapter model as the revision `MODEL@vN`, keeps the newest N, and a
request keeps the revision it named to its end.

One engine start for the module: the engine is started with version 1 of the model `FRESH` (its
pulled served copy) as a static adapter, the reference: what a fresh engine with that adapter
generates. Each test follows with followers of its own, numbers its versions from the latest the
service holds, and leaves the engine as it found it (its revisions unloaded and dropped from the
engine's cache), so that none depends on another having run, or on their order.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import serving
from tests.engines import gate
from tests.engines.engines import PROMPTS, checkpoint, masters
from tests.engines.serving import FollowProcess, VllmServer, following, http, vllm_serve
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import NotFound
from weightsvc.integrations.peft import adapter_state
from weightsvc.protocol.adapter import Adapter

pytestmark = pytest.mark.engine
LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LONG = 1024  # the model length: room for a request that outlasts an update
MODEL, OTHER = "pol", "aux"
FRESH = "fresh"  # the model of the static reference adapter: version 1 only


class AdapterPolicy:
    """A PEFT LoRA adapter (rank 8, q_proj and v_proj) on a tiny Llama; version n has its own weights."""

    def __init__(self, base: torch.nn.Module, seed: int) -> None:
        from peft import LoraConfig, get_peft_model

        self.seed = seed
        self.peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))

    def at(self, version: int, base_dir: Path) -> tuple[dict[str, torch.Tensor], Adapter]:
        g = torch.Generator().manual_seed(self.seed * 1000 + version)
        with torch.no_grad():
            for name, p in self.peft.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        return adapter_state(self.peft, base_model=str(base_dir))


def completion(engine: VllmServer, model: str, prompt: list[int], max_tokens: int = 16) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    choice = http("POST", f"{engine.url}/v1/completions", body)["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def adapters_of(engine: VllmServer) -> list[str]:
    return sorted(c["id"] for c in http("GET", f"{engine.url}/v1/models")["data"] if c.get("parent"))


def cached(engine: VllmServer) -> set[int]:
    """The ids of the adapters the engine's workers hold."""
    return set(http("POST", f"{engine.url}/collective_rpc", {"method": "list_loras"})["results"][0])


def latest(setup: dict[str, Any], model: str) -> int:
    """The newest version of `model` the service holds (0: none yet); a test numbers its versions from it."""
    with InferenceClient(setup["service"].grpc_target) as client:
        try:
            return client.manifest(model).version
        except NotFound:
            return 0


@contextlib.contextmanager
def follow(setup: dict[str, Any], engine: VllmServer, model: str, adapter_dir: Path,
           max_live: int = 2) -> Iterator[FollowProcess]:
    """`weightsvc follow --max-live N` for `model`; on exit the engine is as it was before: the model's
    revisions unloaded, and every adapter loaded since dropped from the engine's cache."""
    before = cached(engine)
    try:
        with following(engine, setup["service"].grpc_target, model, "--max-live", str(max_live),
                       "--adapter-dir", str(adapter_dir)) as f:
            yield f
    finally:
        for name in adapters_of(engine):
            if name.startswith(f"{model}@v"):
                http("POST", f"{engine.url}/v1/unload_lora_adapter", {"lora_name": name})
        for adapter_id in cached(engine) - before:
            http("POST", f"{engine.url}/collective_rpc", {"method": "remove_lora", "args": [adapter_id]})


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("lora")
    module, _ = masters("llama", seed=41)
    base = checkpoint(module, tmp / "base")
    config = json.loads((base / "config.json").read_text())  # room for a long request (RoPE: any length)
    (base / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG}))
    policy = AdapterPolicy(module, seed=1)
    with serving(rounding="sr") as service, LearnerClient(service.grpc_target) as learner:
        yield {"tmp": tmp, "base": base, "policy": policy, "service": service, "learner": learner,
               "other": AdapterPolicy(masters("llama", seed=41)[0], seed=2)}


def push(setup: dict[str, Any], version: int, model: str = MODEL) -> None:
    policy = setup["other"] if model == OTHER else setup["policy"]
    tensors, adapter = policy.at(version, setup["base"])
    setup["learner"].push(version, tensors, model=model, adapter=adapter)


@pytest.fixture(scope="module")
def engine(setup: dict[str, Any]) -> Iterator[VllmServer]:
    """The engine, started with `FRESH` version 1's pulled served copy (and PEFT's own config of it) as
    the static adapter `ref`: what a fresh engine with that adapter generates."""
    push(setup, 1, FRESH)
    ref = setup["tmp"] / "ref"
    ref.mkdir()
    with InferenceClient(setup["service"].grpc_target) as client:
        client.pull_file(ref / "adapter_model.safetensors", FRESH, 1)
    setup["policy"].peft.peft_config["default"].save_pretrained(str(ref))
    with vllm_serve(setup["base"], setup["tmp"] / "engine.log", "--enable-lora", "--max-lora-rank", "8",
                    "--max-loras", "4", "--max-cpu-loras", "4", "--lora-modules", f"ref={ref}",
                    "--logits-processors", gate.CLASS, max_model_len=LONG, env=LORA) as server:
        setup["reference"] = [completion(server, "ref", p) for p in PROMPTS]  # before anything else ran in it
        yield server


def test_revision_generates_as_a_fresh_engine_with_its_served_copy(
        setup: dict[str, Any], engine: VllmServer, tmp_path: Path) -> None:
    reference = setup["reference"]
    with follow(setup, engine, FRESH, tmp_path / "revisions") as follower:
        follower.wait_for("loaded", 1)
        assert adapters_of(engine) == [f"{FRESH}@v1", "ref"]
        live = [completion(engine, f"{FRESH}@v1", p) for p in PROMPTS]
        assert [g["tokens"] for g in live] == [g["tokens"] for g in reference]
        assert [g["logprobs"] for g in live] == [g["logprobs"] for g in reference]
        base = [completion(engine, str(setup["base"]), p) for p in PROMPTS]
        assert [g["tokens"] for g in base] != [g["tokens"] for g in live]  # the adapter moves the answers
        status, body = follower.get("/ready")
        assert status == 200 and json.loads(body)["revisions"] == [f"{FRESH}@v1"]


def test_request_on_a_revision_finishes_on_it_across_the_next_load(
        setup: dict[str, Any], engine: VllmServer, tmp_path: Path) -> None:
    v = latest(setup, MODEL)  # versions v+1 and v+2 live, a request on v+2 across the load of v+3
    with follow(setup, engine, MODEL, tmp_path / "revisions") as follower:
        for version in (v + 1, v + 2):
            push(setup, version)
            follower.wait_for("loaded", version)
        prompt, n = PROMPTS[0], LONG - 2 * len(PROMPTS[0])
        held = gate.Gate(tmp_path / "gate", tokens=4)
        body = {"model": f"{MODEL}@v{v + 2}", "prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True, "vllm_xargs": held.args}
        request = urllib.request.Request(f"{engine.url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        chunks: list[tuple[float, list[int]]] = []
        first = threading.Event()

        def read() -> None:
            with urllib.request.urlopen(request, timeout=300) as response:
                for line in response:
                    if line.startswith(b"data: {"):
                        chunks.append((time.monotonic(), json.loads(line[6:])["choices"][0]["token_ids"]))
                        first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(120)
        # The request is held at its 4th token by the gate and paused there (vLLM's `keep` pause: nothing
        # pauses for an adapter load, and the engine loads it between steps) until the next version is
        # loaded: it spans the load whatever the machine's speed.
        held.pause(engine.url)
        try:
            push(setup, v + 3)
            follower.wait_for("loaded", v + 3)
            loaded = time.monotonic()
        finally:
            http("POST", f"{engine.url}/resume")
        reader.join(300)
        tokens = [t for _, ts in chunks for t in ts]
        assert len(tokens) == n
        assert chunks[-1][0] > loaded, f"the request ended before version {v + 3} was loaded: nothing was tested"
        assert adapters_of(engine) == [f"{MODEL}@v{v + 2}", f"{MODEL}@v{v + 3}", "ref"]
        # On v+2 from its first token to its last:
        assert completion(engine, f"{MODEL}@v{v + 2}", prompt, n)["tokens"] == tokens
        assert completion(engine, f"{MODEL}@v{v + 3}", prompt, n)["tokens"] != tokens


def test_max_live_window_and_adapters_of_two_models(setup: dict[str, Any], engine: VllmServer,
                                                    tmp_path: Path) -> None:
    v = latest(setup, MODEL)
    revisions = tmp_path / "revisions"
    with follow(setup, engine, MODEL, revisions) as follower:
        for version in (v + 1, v + 2, v + 3):
            push(setup, version)
            follower.wait_for("loaded", version)
        follower.wait_for("removed", v + 1, timeout=60)  # unloaded, and once no request runs on it, deleted
        assert adapters_of(engine) == [f"{MODEL}@v{v + 2}", f"{MODEL}@v{v + 3}", "ref"]
        assert sorted(p.name for p in revisions.iterdir()) == [f"{MODEL}@v{v + 2}", f"{MODEL}@v{v + 3}"]
        # The engine's cache holds the live ones and the static one; its LRU alone would keep 4 (--max-cpu-loras).
        assert len(http("POST", f"{engine.url}/collective_rpc", {"method": "list_loras"})["results"][0]) == 3
        push(setup, 1, OTHER)
        with follow(setup, engine, OTHER, revisions, max_live=1) as other:
            other.wait_for("loaded", 1)
            assert adapters_of(engine) == [f"{OTHER}@v1", f"{MODEL}@v{v + 2}", f"{MODEL}@v{v + 3}", "ref"]
            mine, theirs = (completion(engine, m, PROMPTS[1])["tokens"] for m in (f"{MODEL}@v{v + 3}", f"{OTHER}@v1"))
            assert mine != theirs
            # A version whose base is not the engine's is refused by name, and nothing changes.
            tensors, adapter = setup["other"].at(2, setup["base"])
            setup["learner"].push(2, tensors, model=OTHER, adapter=Adapter("another-base", adapter.rank,
                                                                           adapter.alpha, adapter.target_modules))
            refused = other.wait_for("refused")
            assert refused["version"] == 2 and "another-base" in refused["error"]
            assert adapters_of(engine) == [f"{OTHER}@v1", f"{MODEL}@v{v + 2}", f"{MODEL}@v{v + 3}", "ref"]


def test_a_restarted_follower_adopts_the_live_revisions(setup: dict[str, Any], engine: VllmServer,
                                                       tmp_path: Path) -> None:
    v = latest(setup, MODEL)
    revisions = tmp_path / "revisions"
    with follow(setup, engine, MODEL, revisions) as follower:
        for version in (v + 1, v + 2):
            push(setup, version)
            follower.wait_for("loaded", version)
        follower.kill()
        push(setup, v + 3)
        with following(engine, setup["service"].grpc_target, MODEL, "--max-live", "2",
                       "--adapter-dir", str(revisions)) as again:
            assert again.wait_for("connected")["revisions"] == [f"{MODEL}@v{v + 1}", f"{MODEL}@v{v + 2}"]
            again.wait_for("loaded", v + 3)
            again.wait_for("removed", v + 1, timeout=60)
        assert [a for a in adapters_of(engine) if a.startswith(MODEL)] == [f"{MODEL}@v{v + 2}", f"{MODEL}@v{v + 3}"]
        assert sorted(p.name for p in revisions.iterdir()
                      if p.name.startswith(MODEL)) == [f"{MODEL}@v{v + 2}", f"{MODEL}@v{v + 3}"]
