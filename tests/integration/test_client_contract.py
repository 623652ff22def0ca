"""One client contract, both transports: every operation of `InferenceClient` against a real
server, once over gRPC and once over HTTP."""

from __future__ import annotations

import gc
import queue
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import save_file

from tests.conftest import make_masters, serving, start_server, target
from tests.helpers import assert_served, free_port, same_bits, small_step
from weightsvc.client import (
    ClientInfo,
    GrpcInferenceClient,
    GrpcLearnerClient,
    HttpInferenceClient,
    HttpLearnerClient,
    InferenceClient,
    LearnerClient,
    read_version_file,
)
from weightsvc.errors import InvalidArgument, NotFound, Unavailable
from weightsvc.protocol import delta
from weightsvc.server.server import BackgroundServer


def test_the_target_picks_the_transport(server: BackgroundServer, client: InferenceClient, transport: str) -> None:
    expected = GrpcInferenceClient if transport == "grpc" else HttpInferenceClient
    assert type(client) is expected and isinstance(client, InferenceClient)
    assert client.transport == transport


def test_the_target_picks_the_learners_transport(server: BackgroundServer, transport: str) -> None:
    with LearnerClient(target(server, transport)) as learner:
        expected = GrpcLearnerClient if transport == "grpc" else HttpLearnerClient
        assert type(learner) is expected and isinstance(learner, LearnerClient)
        assert learner.transport == transport


def test_pull_gives_the_fair_cast_bits(learner: LearnerClient, client: InferenceClient, model: str) -> None:
    masters = make_masters()
    info = learner.push(5, masters, model=model)
    assert (info.model, info.version, info.created) == (model, 5, True)
    assert (info.format, info.rounding, info.tensor_count) == ("bf16", "sr", len(masters))
    assert_served(client.pull(model), masters, 5)
    assert client.held(model) is not None and client.held(model).version == 5  # type: ignore[union-attr]
    assert client.last_pull_bytes == info.data_bytes
    assert [name for name, _ in client.iter_weights(model, 5)] == list(masters)


def test_versions_manifest_and_models(learner: LearnerClient, client: InferenceClient, model: str) -> None:
    masters = make_masters()
    for step in (1, 2, 10):
        learner.push(step, masters, model=model)
    assert [v.version for v in client.versions(model)] == [1, 2, 10]
    assert all(v.model == model and v.tensor_count == len(masters) for v in client.versions(model))
    manifest = client.manifest(model, "latest")
    assert manifest.version == 10 and manifest.rounding == "sr" and manifest.format == "bf16"
    assert [t.name for t in manifest.tensors] == list(masters)
    assert all(t.checksum.startswith("xxh3_64:") for t in manifest.tensors)
    assert sum(t.nbytes for t in manifest.tensors) == manifest.data_bytes
    summary = next(m for m in client.models() if m["model"] == model)
    assert summary == {"model": model, "latest_version": 10, "versions": [1, 2, 10]}
    with pytest.raises(NotFound, match="nope"):
        client.manifest(model + "-nope")


def test_delta_pull_moves_the_delta_and_gives_the_dense_bits(
    server: BackgroundServer, learner: LearnerClient, client: InferenceClient, model: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    masters = {"layers.0.weight": (torch.randn(512, 512, generator=gen) * 0.02).to(torch.bfloat16).float()}
    learner.push(1, masters, model=model, rounding="rtn")
    learner.push(2, small_step(masters), model=model, rounding="rtn")
    client.pull(model, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch once warned of a read-only buffer on every delta pull
        pulled = client.pull(model, "latest", base=1)
    moved = client.last_pull_bytes
    dense = InferenceClient(server.grpc_target)
    _, old = dense.pull_data(model, 1)
    new_manifest, new = dense.pull_data(model, 2)
    same_bits(pulled, dense.pull(model, 2))
    assert moved == len(delta.encode(new_manifest, new, old)) < new_manifest.data_bytes / 5
    held = client.held(model)
    assert held is not None and (held.version, held.master_digest) == (2, new_manifest.master_digest)


def test_dense_pull_when_the_delta_would_not_be_smaller(
    learner: LearnerClient, client: InferenceClient, model: str
) -> None:
    learner.push(1, {"w": torch.randn(256, 256)}, model=model)
    info = learner.push(2, {"w": torch.randn(256, 256)}, model=model)  # every element changes
    client.pull(model, 1)
    pulled = client.pull(model, 2, base=1)
    assert client.last_pull_bytes == info.data_bytes
    same_bits(pulled, InferenceClient(client.target).pull(model, 2))
    with pytest.raises(InvalidArgument, match="holds no copy of version 1"):
        client.pull(model, 2, base=1)  # it holds version 2 now


def test_pull_file_with_a_base_replaces_the_file(
    learner: LearnerClient, client: InferenceClient, model: str, tmp_path: Path
) -> None:
    masters = make_masters()
    learner.push(1, masters, model=model, rounding="rtn")
    learner.push(2, small_step(masters), model=model, rounding="rtn")
    path = tmp_path / "weights.safetensors"
    assert client.pull_file(path, model, 1).version == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manifest = client.pull_file(path, model, 2, base=1)
    written = read_version_file(path)[0]
    assert (written.version, written.master_digest) == (2, manifest.master_digest) and manifest.version == 2
    assert client.last_pull_bytes < manifest.data_bytes
    same_bits(client.pull(model, 2), InferenceClient(client.target).pull(model, 2))


def test_watch_sends_retained_then_new_versions(learner: LearnerClient, client: InferenceClient, model: str) -> None:
    masters = make_masters()
    learner.push(1, masters, model=model)
    with ThreadPoolExecutor(1) as pool:
        events = client.watch(model)
        assert pool.submit(next, events).result(30).version == 1
        waiting = pool.submit(next, events)  # blocks until the next commit
        learner.push(2, masters, model=model)
        info = waiting.result(30)
        assert (info.model, info.version, info.tensor_count) == (model, 2, len(masters))
        after = InferenceClient(client.target).watch(model, after=2)
        waiting = pool.submit(next, after)
        learner.push(7, masters, model=model)
        assert waiting.result(30).version == 7


def test_watch_ends_when_the_client_closes(learner: LearnerClient, client: InferenceClient, model: str) -> None:
    learner.push(1, make_masters(), model=model)
    events = client.watch(model)
    assert next(events).version == 1
    with ThreadPoolExecutor(1) as pool:
        rest = pool.submit(list, events)  # waits for a version that never comes
        client.close()
        assert rest.result(30) == []


def test_ack_returns_latest_and_lists_the_client(learner: LearnerClient, client: InferenceClient, model: str) -> None:
    masters = make_masters()
    learner.push(1, masters, model=model)
    learner.push(2, masters, model=model)
    assert client.ack(model, 1, "pod-7") == 2
    clients = client.clients(model)
    assert [(c.client_id, c.version, c.lag_versions, c.connected) for c in clients] == [("pod-7", 1, 1, True)]
    assert isinstance(clients[0], ClientInfo) and clients[0].last_seen_unix > 0
    client.ack(model, 2)  # a client id of its own
    assert sorted(c.version for c in client.clients(model)) == [1, 2]


def test_watch_reconnects_across_a_server_restart(data_dir: Path, transport: str) -> None:
    port = free_port()  # a port the restarted server binds again (out of the range connections take theirs from)
    ports = {"grpc_port": port} if transport == "grpc" else {"http_port": port}
    srv = start_server(data_dir=data_dir, **ports)
    events: queue.Queue[int] = queue.Queue()
    watcher = InferenceClient(target(srv, transport))

    def watch() -> None:
        for info in watcher.watch("m"):
            events.put(info.version)
            if info.version == 2:
                return

    threading.Thread(target=watch, daemon=True).start()
    LearnerClient(srv.grpc_target).push(1, make_masters(), model="m")
    assert events.get(timeout=30) == 1
    srv.__exit__(None, None, None)
    with serving(data_dir=data_dir, **ports) as srv:
        LearnerClient(srv.grpc_target).push(2, make_masters(), model="m")
        assert events.get(timeout=30) == 2  # nothing missed, nothing repeated
        assert events.empty()


def test_an_unclosed_http_client_closes_its_sockets_when_garbage(server: BackgroundServer) -> None:
    client = InferenceClient(server.http_url)
    client.models()
    opened = client._connections.opened  # type: ignore[attr-defined]
    assert opened and all(c.sock is not None for c in opened)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del client
        gc.collect()
    assert all(c.sock is None for c in opened)
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_wrong_transport_targets_say_what_to_give(server: BackgroundServer) -> None:
    with pytest.raises(InvalidArgument, match=r"speaks gRPC: give host:port"):
        GrpcInferenceClient(server.http_url)
    http_port = server.http_url.removeprefix("http://")
    with pytest.raises(Unavailable, match=rf"{http_port} answers HTTP, not gRPC"):
        InferenceClient(http_port, timeout=10).manifest()


def test_numpy_masters_push_the_same_bits_without_torch(
    server: BackgroundServer, learner: LearnerClient, model: str, tmp_path: Path
) -> None:
    masters = make_masters(seed=4)
    path = tmp_path / "masters.safetensors"
    save_file(masters, str(path))
    arrays = load_numpy(str(path))
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    # A fresh process: importing the client and pushing numpy arrays loads neither torch nor numba.
    script = (
        "import sys; from safetensors.numpy import load_file; from weightsvc.client import LearnerClient; "
        f"LearnerClient({server.grpc_target!r}).push(1, load_file({str(path)!r}), model={model + '-np'!r}); "
        "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr
    learner.push(1, masters, model=model)
    via_numpy, via_torch = learner_digest(server, model + "-np"), learner_digest(server, model)
    assert via_numpy == via_torch
    with pytest.raises(TypeError, match=r"tensor 'w' is int64; push float32 masters"):
        learner.push(2, {"w": np.arange(4)}, model=model)


def learner_digest(server: BackgroundServer, model: str) -> tuple[str, list[str]]:
    manifest = InferenceClient(server.grpc_target).manifest(model, 1)
    return manifest.master_digest, [t.checksum for t in manifest.tensors]
