"""Relays: a server started with --relay-from mirrors an upstream's versions and serves them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import make_masters, serving, start_server
from tests.helpers import REDIS_URL, needs_redis, relayed, served_file
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import read_version_file
from weightsvc.errors import FailedPrecondition
from weightsvc.protocol.manifest import Manifest
from weightsvc.server.server import BackgroundServer


def upstream_pull_bytes(server: BackgroundServer, model: str) -> float:
    return server.service.metrics.pull_bytes.labels(model, "grpc")._value.get()  # type: ignore[attr-defined]


@pytest.mark.parametrize("relay_data_dir", [False, True], ids=["in-memory", "data-dir"])
def test_relay_mirrors_each_version_bit_for_bit_and_pulls_deltas(tmp_path: Path, model: str,
                                                                  relay_data_dir: bool) -> None:
    masters = make_masters()
    with serving() as upstream, LearnerClient(upstream.grpc_target) as learner:
        learner.push(1, masters, model=model, rounding="sr-sticky")
        # (with a data dir, the delta's base is the committed version's file)
        with serving(relay_from=upstream.grpc_target, data_dir=tmp_path / "relay" if relay_data_dir else None) as relay:
            assert relayed(relay, model, after=None) == 1
            # Same file: the manifest (commit time and lag metrics included) and every served byte.
            assert served_file(relay, model, 1, tmp_path / "r1") == served_file(upstream, model, 1, tmp_path / "u1")
            before = upstream_pull_bytes(upstream, model)
            masters["lm_head.bias"] += 0.5  # one small tensor moves: the relay pulls a delta
            learner.push(2, masters, model=model, rounding="sr-sticky")
            assert relayed(relay, model, after=1) == 2
            relay_pull = upstream_pull_bytes(upstream, model) - before
            assert served_file(relay, model, 2, tmp_path / "r2") == served_file(upstream, model, 2, tmp_path / "u2")
            assert 0 < relay_pull < read_version_file(tmp_path / "u2")[0].data_bytes / 4

            with pytest.raises(FailedPrecondition, match=rf"model '{model}' step 3: this server relays"):
                LearnerClient(relay.grpc_target).push(3, masters, model=model)

            learner.push(1, {"w": torch.ones(3)}, model=model + "-new")  # a model the relay has not seen
            assert relayed(relay, model + "-new", after=None) == 1


def test_relay_keeps_serving_while_the_upstream_is_down_and_catches_up(tmp_path: Path, model: str) -> None:
    masters = make_masters()
    upstream = start_server(data_dir=tmp_path / "up")
    port = upstream.server.grpc_port
    try:
        LearnerClient(upstream.grpc_target).push(1, masters, model=model)
        with serving(relay_from=upstream.grpc_target) as relay:
            assert relayed(relay, model, after=None) == 1
            upstream.__exit__(None, None, None)
            assert InferenceClient(relay.grpc_target).pull(model)["embed.weight"].shape == (97, 64)
            upstream = start_server(data_dir=tmp_path / "up", grpc_port=port)
            LearnerClient(upstream.grpc_target).push(2, masters, model=model)
            assert relayed(relay, model, after=1) == 2
    finally:
        upstream.__exit__(None, None, None)


def test_relay_survives_an_unexpected_exception_counts_it_and_retries(
    monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    masters = make_masters()
    with serving() as upstream, LearnerClient(upstream.grpc_target) as learner:
        learner.push(1, masters, model=model)
        with serving(relay_from=upstream.grpc_target) as relay:
            assert relayed(relay, model, after=None) == 1
            service = relay.service
            mirror, tried = service.mirror, []

            async def fail_once(manifest: Manifest, data: memoryview) -> None:
                tried.append(manifest.version)
                if len(tried) == 1:
                    raise RuntimeError("injected fault")
                await mirror(manifest, data)

            monkeypatch.setattr(service, "mirror", fail_once)
            learner.push(2, masters, model=model)
            assert relayed(relay, model, after=1) == 2
            assert tried == [2, 2]
            assert service.metrics.relay_failures.labels("mirror")._value.get() == 1  # type: ignore[attr-defined]
            learner.push(3, masters, model=model)  # and it goes on following
            assert relayed(relay, model, after=2) == 3


@needs_redis
def test_a_relay_given_the_shared_redis_stays_out_of_the_shards(redis_prefix: str, model: str) -> None:
    """Relays take the deployment's shared settings, Redis included: a relay must not register as a
    shard (learners would push its tensors to it and fail), and pushes and relaying go on."""
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix}
    with serving(**shared) as upstream, serving(relay_from=upstream.grpc_target, **shared) as relay:
        assert [r.id for r in InferenceClient(upstream.grpc_target).topology()] == [upstream.server.replica.id]
        with LearnerClient(upstream.grpc_target) as learner:
            learner.push(1, make_masters(), model=model)
        assert relayed(relay, model, None) == 1
        assert sorted(InferenceClient(relay.http_url).pull(model, 1)) == sorted(make_masters())
