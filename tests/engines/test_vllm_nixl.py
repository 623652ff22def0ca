"""`vllm serve --weight-transfer-config '{"backend": "weightsvc-nixl"}'`: each tensor-parallel worker
READs its slice of a version over NIXL from a `serve --nixl` server into its staging while the engine
generates, then swaps it in; against a server that lends nothing over NIXL, it says so in one line per
worker and pulls over TCP.

One engine start (TP 2, one core per worker). The version it starts from is published, not pushed: two
learner ranks (gloo, FSDP2 with `served_params`) each publish their rows of the served copy their
all-gather serves (`rank_served`), which the server READs over NIXL and commits; the ranks check the
committed copy is, bit for bit, what their forward runs on. The engine starts from the pulled served
copy of that version (`sr`), so its first answers are a fresh server's of that copy. It then loads
another model's version and back again, both over NIXL, and must answer as it did fresh, tokens and
log-probabilities. The fallback loads that other model's version from a second server without NIXL: the
service rounds deterministically (seed, version, tensor, element), so the same masters pushed as the
same version are served bit for bit the same by both servers.
"""

from __future__ import annotations

import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import serving
from tests.engines.engines import checkpoint, masters, served_checkpoint, step
from tests.engines.serving import following, vllm_serve
from tests.helpers import free_port, same_bits
from weightsvc import InferenceClient, LearnerClient
from weightsvc.integrations.vllm.plugin import NIXL_BACKEND
from weightsvc.rounding import ExportSpec
from weightsvc.server.server import BackgroundServer

pytestmark = pytest.mark.engine
HOME, AWAY = "llama-home", "llama-away"  # the version the engine starts from, and another one
AWAY_VERSION = 5  # (the engine's label is the version number: it must differ from HOME's 1)
RANKS, SEED = 2, 53
SPEC = ExportSpec("bf16", "sr", seed=0)  # the server's (`serving(rounding="sr")`)


@pytest.fixture(scope="module")
def lending() -> Iterator[BackgroundServer]:
    with serving(rounding="sr", nixl=True) as srv:
        yield srv


def _publish_home(rank: int, port: int, target: str) -> None:
    """A learner rank: the Llama one step on (HOME's masters), its parameters Fair Cast in FSDP2's
    all-gather, publishes its rows of version 1's served copy; then checks the committed copy is what
    its forward's all-gather serves, and that the service recorded the version's lag from the ranks."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from weightsvc.client import RankLag
    from weightsvc.integrations.fsdp import rank_served, rank_shards, served_params

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        module, _ = masters("llama", seed=SEED)
        step(module, 1)
        served_params(module, SPEC, version=1)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in module.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(module, mp_policy=policy)
        dist.barrier()  # (every rank wrapped: the server waits for the others from the first request on)
        with LearnerClient(target) as learner:
            info = learner.publish(1, rank_served(module, version=1), HOME, rank=rank, world_size=RANKS, spec=SPEC,
                                   masters=rank_shards(module), lag=RankLag())
        assert (info.model, info.version) == (HOME, 1)
        groups = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for group in groups:
            group.unshard()
        gathered = {n: p.detach().clone() for n, p in module.named_parameters()}
        for group in groups:
            group.reshard()
        with InferenceClient(target) as client:
            same_bits(client.pull(HOME, 1), gathered)
            assert [v.lag is not None for v in client.versions(HOME)] == [True]
    finally:
        dist.destroy_process_group()


def nixl_reads(srv: BackgroundServer, model: str) -> float:
    text = urllib.request.urlopen(f"{srv.http_url}/metrics", timeout=30).read().decode()
    found = re.search(rf'^weightsvc_nixl_reads_total{{model="{model}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.timeout(600)  # a TP 2 engine start and three updates: 113 s here, past the suite's 300 s on a busy machine
def test_two_fsdp_ranks_publish_workers_read_their_slices_over_nixl_and_answer_as_a_fresh_engine(
    lending: BackgroundServer, tmp_path: Path
) -> None:
    module, _ = masters("llama", seed=SEED)
    start = checkpoint(module, tmp_path / "v0")
    step(module, 1)  # (HOME's masters: the ranks publish them)
    away = {n: t.clone() for n, t in step(module, 2).items()}
    mp.spawn(_publish_home, args=(free_port(), lending.grpc_target), nprocs=RANKS, join=True)
    with serving(rounding="sr") as tcp_only, LearnerClient(lending.grpc_target) as learner, \
            LearnerClient(tcp_only.grpc_target) as other:
        learner.push(AWAY_VERSION, away, model=AWAY)
        other.push(AWAY_VERSION, away, model=AWAY)
        pulled = served_checkpoint(start, lending.grpc_target, HOME, 1, tmp_path / "home")
        with vllm_serve(pulled, tmp_path / "engine.log", "--weight-transfer-config", f'{{"backend": "{NIXL_BACKEND}"}}',
                        "--tensor-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as engine:
            fresh = engine.generate()
            with following(engine, lending.grpc_target, AWAY) as follower:
                staged = follower.wait_for("staged", AWAY_VERSION)
                follower.wait_for("update", AWAY_VERSION)
            moved = engine.generate()
            assert [g[0] for g in moved] != [g[0] for g in fresh]  # the other version answers otherwise
            assert nixl_reads(lending, AWAY) == 2  # one READ per worker, its slice
            assert len(staged["pulled_bytes"]) == 2
            with following(engine, lending.grpc_target, HOME) as follower:
                follower.wait_for("update", 1)
            assert engine.weight_version() == "1" and nixl_reads(lending, HOME) == 2
            assert engine.generate() == fresh  # tokens and log-probabilities, as the fresh engine's
            said = (tmp_path / "engine.log").read_text()
            assert "NIXL cannot reach" not in said
            with following(engine, tcp_only.grpc_target, AWAY) as follower:
                follower.wait_for("update", AWAY_VERSION)
            assert engine.generate() == moved
    said = (tmp_path / "engine.log").read_text()
    assert said.count("NIXL cannot reach") == 2, said[-3000:]  # one line per worker, then over TCP
