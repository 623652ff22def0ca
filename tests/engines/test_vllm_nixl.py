"""`vllm serve --weight-transfer-config '{"backend": "weightsvc-nixl"}'`: each tensor-parallel worker
READs its slice of a version over NIXL from a `serve --nixl` server into its staging while the engine
generates, then swaps it in; against a server that lends nothing over NIXL, it says so in one line per
worker and pulls over TCP.

One engine start (TP 2, one core per worker): the engine starts from the pulled served copy of a version
(`sr`), so its first answers are a fresh server's of that copy. It then loads another model's version
and back again, both over NIXL, and must answer as it did fresh, tokens and log-probabilities. The
fallback loads that other model's version from a second server without NIXL: the service rounds
deterministically (seed, version, tensor, element), so the same masters pushed as the same version
are served bit for bit the same by both servers.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import serving
from tests.engines.engines import checkpoint, masters, served_checkpoint
from tests.engines.serving import following, vllm_serve
from tests.engines.test_vllm import step
from weightsvc import LearnerClient
from weightsvc.integrations.vllm.plugin import NIXL_BACKEND
from weightsvc.server.server import BackgroundServer

pytestmark = pytest.mark.engine
HOME, AWAY = "llama-home", "llama-away"  # the version the engine starts from, and another one
AWAY_VERSION = 5  # (the engine's label is the version number: it must differ from HOME's 1)


@pytest.fixture(scope="module")
def lending() -> Iterator[BackgroundServer]:
    with serving(rounding="sr", nixl=True) as srv:
        yield srv


def nixl_reads(srv: BackgroundServer, model: str) -> float:
    text = urllib.request.urlopen(f"{srv.http_url}/metrics", timeout=30).read().decode()
    found = re.search(rf'^weightsvc_nixl_reads_total{{model="{model}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.timeout(600)  # a TP 2 engine start and three updates: 113 s here, past the suite's 300 s on a busy machine
def test_workers_read_their_slices_over_nixl_and_answer_as_a_fresh_engine_of_the_pulled_copy(
    lending: BackgroundServer, tmp_path: Path
) -> None:
    module, _ = masters("llama", seed=53)
    start = checkpoint(module, tmp_path / "v0")
    home = {n: t.clone() for n, t in step(module, 1).items()}
    away = {n: t.clone() for n, t in step(module, 2).items()}
    with serving(rounding="sr") as tcp_only, LearnerClient(lending.grpc_target) as learner, \
            LearnerClient(tcp_only.grpc_target) as other:
        learner.push(1, home, model=HOME)
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
