"""Shared fixtures: real servers on port 0 (in-process, on their own loop thread)."""

from __future__ import annotations

import os

# The Triton kernels run on this CPU through Triton's interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from weightsvc import InferenceClient, LearnerClient, Settings

# `weightsvc serve` as a process of its own (for tests that kill it): the package's harness, which the bench uses too
from weightsvc.cli._server import WEIGHTSVC_CMD as WEIGHTSVC_CMD
from weightsvc.cli._server import ServeProcess as ServeProcess
from weightsvc.server.server import BackgroundServer

# The suite draws the same examples every run, so a red CI names a change, not a lucky draw;
# `HYPOTHESIS_PROFILE=explore` draws new ones each run (fuzzing by hand).
settings.register_profile("suite", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

# The shared helpers assert too: their failures read like the tests' own.
pytest.register_assert_rewrite("tests.helpers")


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A Redis key prefix of the test's own (registries and replicas keep apart); deleted afterwards."""
    import redis

    from tests.helpers import REDIS_URL

    prefix = f"weightsvc-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


def serving(**overrides: object) -> BackgroundServer:
    """A service on ports 0, for `with serving(...) as srv:`."""
    return BackgroundServer(Settings(**{"grpc_port": 0, "http_port": 0, "probe_port": 0, **overrides}))


def start_server(**overrides: object) -> BackgroundServer:
    """A started service, for tests that stop and restart it themselves."""
    return serving(**overrides).__enter__()


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    """One service per test module; tests keep apart by using their own model names."""
    srv = start_server()
    yield srv
    srv.__exit__(None, None, None)


# The client contract holds on every transport: tests over both take `client` or `transport`.
TRANSPORTS = ["grpc", "http"]


def target(srv: BackgroundServer, transport: str) -> str:
    return srv.grpc_target if transport == "grpc" else srv.http_url


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client(server: BackgroundServer, transport: str) -> Iterator[InferenceClient]:
    with InferenceClient(target(server, transport)) as c:
        yield c


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100]


@pytest.fixture
def learner(server: BackgroundServer) -> Iterator[LearnerClient]:
    with LearnerClient(server.grpc_target) as client:
        yield client


@pytest.fixture(params=TRANSPORTS)
def push_transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pusher(server: BackgroundServer, push_transport: str) -> Iterator[LearnerClient]:
    """A learner on each transport: tests of the push contract take it, and run over both."""
    with LearnerClient(target(server, push_transport)) as client:
        yield client


@pytest.fixture
def puller(server: BackgroundServer) -> Iterator[InferenceClient]:
    with InferenceClient(server.grpc_target) as client:
        yield client


def make_masters(seed: int = 0, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """A small transformer-shaped state dict of fp32 masters, odd sizes included."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (97, 64),
        "layers.0.attn.qkv.weight": (192, 64),
        "layers.0.mlp.up.weight": (300, 64),  # 76,800 bytes: several chunks at 16 KiB
        "layers.0.norm.weight": (64,),
        "lm_head.bias": (97,),
        "scalar": (),
    }
    return {name: torch.randn(shape, generator=gen) * scale for name, shape in shapes.items()}


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture(scope="session")
def nixl_installed() -> None:
    """CI installs the [nixl] extra (scripts/setup.sh) and sets WEIGHTSVC_REQUIRE_NIXL=1: there a
    missing NIXL fails the run instead of skipping every read."""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        if os.environ.get("WEIGHTSVC_REQUIRE_NIXL") == "1":
            pytest.fail("needs NIXL: pip install 'weightsvc[nixl]'")
        pytest.skip("needs NIXL: pip install 'weightsvc[nixl]'")
