"""`vllm serve` follows weightsvc through `weightsvc follow`: vLLM's own RL API with weightsvc's
weight-transfer backend, and the worker extension's `/collective_rpc` for engines without it.

Engine starts are what these tests cost (about a minute and a half each here), so three servers
serve the module, and fresh references come from servers that then follow: the service rounds to
nearest, so a version pushed from the same masters as an earlier one is served bit for bit as it
was, and an engine that loads it in place must then answer as the fresh engine started from it did.
- `llama` (weightsvc's backend) starts from version 1's served copy: its first answers are version
  1's fresh ones. Its tests push versions made of version 1's or version 2's masters, and compare.
- `rpc` (the worker extension only) starts from version 2's served copy: version 2's fresh answers;
  then it follows a model of its own through `/collective_rpc`.
- `qwen2` (head tied to the embeddings, weightsvc's backend) does the same round trip on its own.
The tests share engines, never an order: each numbers its versions from the latest the service
holds, and one that needs the engine on a version (not on the checkpoint it started from) gets it
from `on_latest`."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import serving
from tests.engines import gate
from tests.engines.engines import checkpoint, masters, served_checkpoint, step
from tests.engines.serving import BACKEND, FollowProcess, VllmServer, following, http, vllm_serve
from tests.helpers import bits
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import NotFound
from weightsvc.integrations.vllm.follower import UPDATING
from weightsvc.loaders import tp_select
from weightsvc.server.server import BackgroundServer

pytestmark = pytest.mark.engine
LONG = 2048  # the model length of the engine that answers a long request across an update
RPC_MODEL = "llama-rpc"  # what `rpc` follows: its acks are not among those of `llama`'s followers


def acked(server: BackgroundServer, model: str) -> dict[str, int]:
    return {c.client_id: c.version for c in server.service.clients(model)}


def latest(service: BackgroundServer, model: str = "llama") -> int:
    """The newest version of `model` the service holds (0: none yet); a test numbers its versions from it."""
    with InferenceClient(service.grpc_target) as client:
        try:
            return client.manifest(model).version
        except NotFound:
            return 0


def on_latest(service: BackgroundServer, learner: LearnerClient, llama: dict[str, Any]) -> int:
    """The version the `llama` engine serves, the latest of the model: when it serves another (or still
    the checkpoint it started from), a version of version 1's masters is pushed and followed first."""
    engine: VllmServer = llama["engine"]
    version = latest(service)
    if engine.weight_version() != str(version):
        version += 1
        learner.push(version, llama["policy"].at(1), model="llama")
        with following(engine, service.grpc_target, "llama") as follower:
            follower.wait_for("update", version)
    return version


def generate_streamed(engine: VllmServer, prompt: list[int], max_tokens: int, generating: threading.Event,
                      held: gate.Gate) -> dict[str, Any]:
    """One greedy generation through the gate `held`, streamed: `generating` is set once its first tokens came;
    its token ids and its `weight_versions` (on the last chunk) when it ends."""
    params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "extra_args": held.args}
    body = {"token_ids": prompt, "sampling_params": params, "stream": True}
    request = urllib.request.Request(f"{engine.url}/inference/v1/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    tokens: list[int] = []
    spans = None
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
                    spans = choice.get("weight_versions") or spans
                if tokens:
                    generating.set()
    return {"tokens": tokens, "weight_versions": spans}


class Policy:
    """A model's masters as a learner moves them: version n+1 is a step from version n."""

    def __init__(self, kind: str, seed: int) -> None:
        self.module, _ = masters(kind, seed=seed)
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def at(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.states:  # a copy that keeps the ties (tensors sharing memory) tied
            copies: dict[int, torch.Tensor] = {}
            self.states[version] = {n: copies.setdefault(t.data_ptr(), t.clone())
                                    for n, t in step(self.module, version).items()}
        return self.states[version]


@pytest.fixture(scope="module")
def service() -> Iterator[BackgroundServer]:
    with serving(rounding="rtn") as srv:  # the same masters are served bit for bit the same
        yield srv


@pytest.fixture(scope="module")
def learner(service: BackgroundServer) -> Iterator[LearnerClient]:
    with LearnerClient(service.grpc_target) as client:
        yield client


@pytest.fixture(scope="module")
def llama(service: BackgroundServer, learner: LearnerClient,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The Llama engines: `engine` (backend, from version 1) and `rpc` (worker extension, from version
    2), started together, with the fresh answers of versions 1 and 2."""
    tmp = tmp_path_factory.mktemp("llama")
    policy = Policy("llama", seed=31)
    start = checkpoint(policy.module, tmp / "v0")
    config = json.loads((start / "config.json").read_text())  # room for a long request (RoPE: any length)
    (start / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LONG}))
    for version in (1, 2):
        learner.push(version, policy.at(version), model="llama")
    v1 = served_checkpoint(start, service.grpc_target, "llama", 1, tmp / "v1")
    v2 = served_checkpoint(start, service.grpc_target, "llama", 2, tmp / "v2")
    engine = VllmServer(v1, tmp / "engine.log", "--weight-transfer-config", BACKEND, "--logits-processors", gate.CLASS,
                        max_model_len=LONG)
    rpc = VllmServer(v2, tmp / "rpc.log", "--worker-extension-cls", "weightsvc.loaders.VllmWorkerExtension")
    try:
        engine.wait_ready()
        rpc.wait_ready()
        yield {"engine": engine, "rpc": rpc, "policy": policy, "label": engine.weight_version(),
               "fresh": {1: engine.generate(), 2: rpc.generate()}}
    finally:
        engine.stop()
        rpc.stop()


def test_the_backend_follows_two_versions_each_as_a_fresh_engine_answers(
    service: BackgroundServer, learner: LearnerClient, llama: dict[str, Any]
) -> None:
    engine: VllmServer = llama["engine"]
    fresh = llama["fresh"]
    assert fresh[1] != fresh[2]  # the versions differ in what they generate
    assert llama["label"] == "default"  # as started: no version yet, nothing to ack
    v = latest(service)
    learner.push(v + 1, llama["policy"].at(1), model="llama")
    learner.push(v + 2, llama["policy"].at(2), model="llama")
    with following(engine, service.grpc_target, "llama") as follower:
        connected = follower.wait_for("connected")
        assert connected["path"] == "transfer"
        # Version v+2 is the latest when it starts: version v+1 is skipped, never loaded.
        update = follower.wait_for("update", v + 2)
        assert engine.weight_version() == str(v + 2)
        assert acked(service, "llama") == {"follow-llama": v + 2}
        assert engine.generate() == fresh[2]
        assert all(s == [{"version": str(v + 2), "start": 0, "end": 16}] for s in engine.spans())
        assert 0 < update["pause_s"] < update["update_s"]

        learner.push(v + 3, llama["policy"].at(1), model="llama")  # version v+1's masters again
        with InferenceClient(service.grpc_target) as client:  # (version 1 itself may be retained no more)
            v1, v3 = client.pull("llama", v + 1), client.pull("llama", v + 3)
        assert all(np.array_equal(bits(v1[n]), bits(v3[n])) for n in v1)
        follower.wait_for("update", v + 3)
        assert engine.weight_version() == str(v + 3) and acked(service, "llama") == {"follow-llama": v + 3}
        assert engine.generate() == fresh[1]

        status, body = follower.get("/ready")
        assert status == 200 and f'"served": {v + 3}' in body
        _, metrics = follower.get("/metrics")
        assert 'weightsvc_follower_update_seconds_count{path="transfer"} 2.0' in metrics
        assert f"weightsvc_follower_engine_version {v + 3}.0" in metrics
        assert "weightsvc_follower_versions_behind 0.0" in metrics
    assert not any(e["event"] == "update" and e["version"] == v + 1 for e in list(follower.events.queue))


def test_a_version_that_does_not_fit_is_refused_and_the_engine_keeps_its_weights(
    service: BackgroundServer, learner: LearnerClient, llama: dict[str, Any]
) -> None:
    engine: VllmServer = llama["engine"]
    served = on_latest(service, learner, llama)
    before = engine.generate()
    wrong = {n: t for n, t in llama["policy"].at(1).items() if "layers.1." not in n}  # a layer short
    learner.push(served + 1, wrong, model="llama")
    with following(engine, service.grpc_target, "llama") as follower:
        refused = follower.wait_for("refused", served + 1)
        assert refused["stage"] == "stage"
        assert f"model 'llama' version {served + 1}" in refused["error"]
        assert "lacks tensor 'model.layers.1." in refused["error"]
        assert engine.weight_version() == str(served) and engine.generate() == before
        assert acked(service, "llama") == {"follow-llama": served}
        status, _ = follower.get("/ready")
        assert status == 503  # a version behind, with --max-lag 0
        _, metrics = follower.get("/metrics")
        assert 'weightsvc_follower_failures_total{stage="stage"} 1.0' in metrics
        # The next version that fits is loaded (version 2's masters: version 2's fresh answers).
        learner.push(served + 2, llama["policy"].at(2), model="llama")
        follower.wait_for("update", served + 2)
        assert engine.generate() == llama["fresh"][2]
        assert acked(service, "llama") == {"follow-llama": served + 2}


def test_a_request_across_an_update_shows_the_two_versions_that_generated_it(
    service: BackgroundServer, learner: LearnerClient, llama: dict[str, Any], tmp_path: Path
) -> None:
    engine: VllmServer = llama["engine"]
    served = on_latest(service, learner, llama)
    version = served + 1
    prompt = [1, 5, 9, 33, 70]  # (5 tokens: LONG - 5 more fill the engine's model length)
    held = gate.Gate(tmp_path / "gate", tokens=4)
    with following(engine, service.grpc_target, "llama") as follower:
        follower.wait_for("connected")
        out: dict[str, Any] = {}
        generating = threading.Event()
        long = threading.Thread(target=lambda: out.update(
            generate_streamed(engine, prompt, LONG - 5, generating, held)))
        long.start()
        assert generating.wait(120)
        # The request is held at its 4th token by the gate and paused there (vLLM's `keep` pause), and the
        # pause is handed to the follower under its own label, as a follower that was stopped in the
        # middle of the update leaves it: the follower takes it as its own, swaps, and its resume lets the
        # request go on. The request spans the update whatever the machine's speed.
        held.pause(engine.url)
        try:
            http("POST", f"{engine.url}/update_weight_version", {"new_version": f"{UPDATING}{version}"})
            learner.push(version, llama["policy"].at(1 + version % 2), model="llama")
            paused = follower.wait_for("paused", version)
            assert paused["mode"] == "keep"
            follower.wait_for("update", version)
        finally:
            if http("GET", f"{engine.url}/is_paused")["is_paused"]:  # (the follower failed: let the request end)
                http("POST", f"{engine.url}/resume")
        long.join(300)
    spans = out["weight_versions"]
    assert [s["version"] for s in spans] == [str(version - 1), str(version)]  # in flight across the swap
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == len(out["tokens"]) == LONG - len(prompt)
    assert spans[0]["end"] <= held.held  # (paused where the gate held it)


def test_a_follower_killed_in_the_middle_of_an_update_converges_when_restarted(
    service: BackgroundServer, learner: LearnerClient, llama: dict[str, Any]
) -> None:
    engine: VllmServer = llama["engine"]
    served = on_latest(service, learner, llama)
    follower = FollowProcess(engine, service.grpc_target, "llama")
    try:
        follower.wait_for("connected")
        learner.push(served + 1, llama["policy"].at(2), model="llama")
        follower.wait_for("paused", served + 1)
        follower.kill()  # the engine is left paused, labelled as in an update of that version
    finally:
        follower.stop()
    learner.push(served + 2, llama["policy"].at(1), model="llama")  # and the learner went on meanwhile
    with following(engine, service.grpc_target, "llama") as again:
        again.wait_for("update", served + 2, timeout=200)
    assert http("GET", f"{engine.url}/is_paused")["is_paused"] is False
    assert engine.weight_version() == str(served + 2) and acked(service, "llama") == {"follow-llama": served + 2}
    assert engine.generate() == llama["fresh"][1]


def test_an_engine_with_the_worker_extension_only_follows_through_collective_rpc(
    service: BackgroundServer, learner: LearnerClient, llama: dict[str, Any]
) -> None:
    rpc: VllmServer = llama["rpc"]
    version = latest(service, RPC_MODEL) + 1
    learner.push(version, llama["policy"].at(1), model=RPC_MODEL)
    with following(rpc, service.grpc_target, RPC_MODEL, "--client-id", "rpc") as follower:
        assert follower.wait_for("connected")["path"] == "collective_rpc"
        update = follower.wait_for("update", version)
    assert update["path"] == "collective_rpc"
    assert rpc.weight_version() == str(version) and acked(service, RPC_MODEL)["rpc"] == version
    assert rpc.generate() == llama["fresh"][1]  # the latest is version 1's masters
    assert all(s == [{"version": str(version), "start": 0, "end": 16}] for s in rpc.spans())


def round_trip(engine: VllmServer, follower: FollowProcess, learner: LearnerClient, policy: Policy,
               model: str) -> tuple[Any, Any, dict[str, Any]]:
    """After version 1, version 2 (a step on) and version 3 (version 1's masters again) in turn: what
    the engine generates on each, and the staging report of version 3."""
    follower.wait_for("update", 1)
    learner.push(2, policy.at(2), model=model)
    follower.wait_for("update", 2)
    moved = engine.generate()
    learner.push(3, policy.at(1), model=model)
    staged = follower.wait_for("staged", 3)
    follower.wait_for("update", 3)
    return moved, engine.generate(), staged


def test_a_tied_model_follows_and_answers_as_fresh(service: BackgroundServer, learner: LearnerClient,
                                                   tmp_path: Path) -> None:
    policy = Policy("qwen2", seed=37)
    start = checkpoint(policy.module, tmp_path / "v0")
    state = policy.at(1)
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    learner.push(1, state, model="qwen2")
    v1 = served_checkpoint(start, service.grpc_target, "qwen2", 1, tmp_path / "v1")
    with vllm_serve(v1, tmp_path / "qwen2.log", "--weight-transfer-config", BACKEND) as engine:
        fresh = engine.generate()
        with following(engine, service.grpc_target, "qwen2") as follower:
            moved, back, _ = round_trip(engine, follower, learner, policy, "qwen2")
    assert back == fresh
    assert [g[0] for g in moved] != [g[0] for g in fresh]


def test_tensor_parallel_workers_stage_their_slices(service: BackgroundServer, learner: LearnerClient,
                                                    tmp_path: Path) -> None:
    # Two workers, one core each (this machine has 2): each stages its slice of every version, and
    # the round trip (version 3 holds version 1's masters) answers as the fresh TP 2 engine did.
    policy = Policy("llama", seed=41)
    start = checkpoint(policy.module, tmp_path / "v0")
    learner.push(1, policy.at(1), model="llama-tp")
    v1 = served_checkpoint(start, service.grpc_target, "llama-tp", 1, tmp_path / "v1")
    with vllm_serve(v1, tmp_path / "tp.log", "--weight-transfer-config", BACKEND, "--tensor-parallel-size", "2",
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as engine:
        fresh = engine.generate()
        with following(engine, service.grpc_target, "llama-tp") as follower:
            moved, back, staged = round_trip(engine, follower, learner, policy, "llama-tp")
    assert back == fresh
    assert [g[0] for g in moved] != [g[0] for g in fresh]
    manifest = InferenceClient(service.grpc_target).manifest("llama-tp", 3)
    select = tp_select(manifest, 0, 2, num_kv_heads=2, head_dim=32)
    sliced = sum(t.nbytes for t in manifest.tensors if select[t.name] is not None)
    whole = manifest.data_bytes - sliced
    assert len(staged["pulled_bytes"]) == 2
    for pulled in staged["pulled_bytes"]:  # framing aside, half of every sliced tensor
        assert whole + sliced / 2 <= pulled <= whole + sliced / 2 + 64 * 1024
