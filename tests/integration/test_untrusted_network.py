"""Nothing from the network is trusted: a hostile server (tests/hostile.py, speaking weightsvc's
protocol) answers manifests that name paths, other models and versions, absurd sizes and 3,000
models. Clients refuse them over both transports before allocating anything for them; a relay refuses
them with a logged and counted reason, writes nothing outside its data dir, keeps its memory, holds
one connection to its upstream and follows at most --max-models models; the data dir refuses every
path outside it."""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_masters, serving
from tests.helpers import http_get
from tests.hostile import HostileGrpc, HostileHttp, Served, altered, claiming, established
from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli._server import ServeProcess
from weightsvc.client import Limits
from weightsvc.errors import DataLoss, InvalidArgument, ResourceExhausted, WeightsvcError
from weightsvc.memory import physical_memory, process_status
from weightsvc.protocol.digest import checksum
from weightsvc.protocol.manifest import Manifest, ServedTensor
from weightsvc.service.versions.disk import VersionFiles

MiB = 1 << 20


@pytest.fixture(scope="module")
def template() -> tuple[Manifest, bytes]:
    """A real version's manifest and data section, for the hostile servers to alter."""
    with serving() as srv, LearnerClient(srv.grpc_target) as learner:
        learner.push(1, make_masters(), model="m")
        manifest, data = InferenceClient(srv.grpc_target).pull_data("m", 1)
    return manifest, bytes(data)


# What a hostile server sends for version 5 of model "evil", and how a client answers it.
Alter = Callable[[Manifest], Manifest]
BAD: dict[str, tuple[Alter, type[WeightsvcError], str]] = {
    "a model name with ../": (lambda m: altered(m, model="../../escape"), DataLoss,
                              "model name '../../escape' is invalid"),
    "another model": (lambda m: altered(m, model="other"), DataLoss, "model 'evil' was asked for"),
    "another version": (lambda m: altered(m, version=7), DataLoss, "version 5 was asked for"),
    "data_bytes 3 GiB for 74 KiB of tensors": (lambda m: altered(m, data_bytes=3 << 30), DataLoss,
                                               r"data_bytes is 3221225472, and its 6 tensors take 75716"),
    "a gap before a tensor": (lambda m: altered(m, tensor0={"offset": 8}), DataLoss,
                              "starts at byte 8 of the data section, where the tensors before it end at 0"),
    "bytes the shape does not take": (lambda m: altered(m, tensor0={"nbytes": 1 << 30}), DataLoss,
                                      "bytes as the shape takes"),
    "a negative size": (lambda m: altered(m, tensor0={"shape": (-1, 64)}), DataLoss, "whole numbers ≥ 0"),
    "an unknown dtype": (lambda m: altered(m, tensor0={"dtype": "Q99"}), DataLoss, "dtype 'Q99'"),
    # (over HTTP its entry in the file's header takes the manifest's place)
    "a reserved tensor name": (lambda m: altered(m, tensor0={"name": "__metadata__"}), DataLoss,
                               "'__metadata__' is reserved|carries no weightsvc manifest|"
                               r"header names \['__metadata__'\] more than once"),
    "a sound manifest of 1 TiB": (lambda m: claiming(m, 1 << 40), ResourceExhausted,
                                  "1099511627776 bytes is more than the"),
}


@pytest.fixture(params=["grpc", "http"])
def hostile(request: pytest.FixtureRequest, template: tuple[Manifest, bytes]) -> Iterator[
        Callable[[Manifest], str]]:
    """A hostile server of the transport; `serve(manifest)` makes it answer `manifest` for version 5 of
    model "evil" and returns the target a client reaches it at."""
    served: dict[str, Served] = {}
    server = HostileGrpc(served) if request.param == "grpc" else HostileHttp(served)
    with server:
        def serve(manifest: Manifest) -> str:
            served["evil"] = Served(5, manifest, template[1])
            return server.target if isinstance(server, HostileGrpc) else server.url

        yield serve


@pytest.mark.parametrize("case", list(BAD))
def test_a_client_refuses_a_bad_manifest_before_allocating_for_it(
    hostile: Callable[[Manifest], str], template: tuple[Manifest, bytes], case: str
) -> None:
    alter, error, message = BAD[case]
    target = hostile(alter(altered(template[0], model="evil", version=5)))
    peak = process_status()["VmHWM"]
    with InferenceClient(target) as client:
        with pytest.raises(error, match=message):
            client.pull_data("evil", 5)
        with pytest.raises(error, match=message):
            client.manifest("evil", 5)
        assert client.held("evil") is None
    assert process_status()["VmHWM"] - peak < 256 * MiB  # nothing of what was claimed was taken


def test_a_client_takes_what_its_limits_allow(hostile: Callable[[Manifest], str],
                                                 template: tuple[Manifest, bytes]) -> None:
    target = hostile(altered(template[0], model="evil", version=5))
    with InferenceClient(target) as client:
        assert client.limits.max_bytes == physical_memory() // 2  # the default: half the memory it may use
        assert client.pull_data("evil", 5)[0].data_bytes == template[0].data_bytes
    size = template[0].data_bytes
    with InferenceClient(target, limits=Limits(max_bytes=size - 1)) as client, pytest.raises(
            ResourceExhausted, match=f"of {size} bytes is more than the {size - 1} bytes"):
        client.pull_data("evil", 5)


def test_an_http_watch_refuses_an_endless_event() -> None:
    with HostileHttp({}) as server, InferenceClient(server.url) as client:
        server.event = b"event: version\ndata: " + b"9" * (16 << 20) + b"\n\n"
        with pytest.raises(DataLoss, match="sent an event over 65536 bytes a line"):
            next(iter(client.watch("evil", reconnect=False)))
        server.event = b"event: version\n" + b"data: 9\n" * 100_000 + b"\n"
        with pytest.raises(DataLoss, match="or 64 lines"):
            next(iter(client.watch("evil", reconnect=False)))


# ---- the relay ------------------------------------------------------------------------------------


def metrics(relay: ServeProcess) -> dict[tuple[str, str], float]:
    body = http_get(relay.url, "/metrics")[2].decode()
    return {(s.name, s.labels.get("reason", "")): s.value for f in text_string_to_metric_families(body)
            for s in f.samples if s.name.startswith("weightsvc_relay")}


def relayed(relay: ServeProcess, model: str, timeout: float = 60) -> int:
    """The first version of `model` the relay holds (waits on its Watch stream)."""
    got: queue.Queue[int] = queue.Queue()

    def watch() -> None:
        with InferenceClient(relay.target) as client:
            got.put(next(iter(client.watch(model))).version)

    threading.Thread(target=watch, daemon=True).start()
    return got.get(timeout=timeout)


def pulled_twice(models: list[str]) -> Callable[[Counter[tuple[str, str]]], bool]:
    """Every model pulled twice: its first refusal was counted before the relay tried again."""
    return lambda calls: all(calls["Pull", m] >= 2 for m in models)


def test_a_relay_refuses_a_hostile_upstream_with_reasons_and_writes_only_in_its_data_dir(
    tmp_path: Path, template: tuple[Manifest, bytes]
) -> None:
    manifest, data = template
    served = {
        "good": Served(1, altered(manifest, model="good"), data),
        "../../escape": Served(1, altered(manifest, model="../../escape"), data),  # listed as a path
        "evil-name": Served(1, altered(manifest, model="../../escape-too"), data),  # its manifest names a path
        "evil-model": Served(1, altered(manifest, model="other"), data),
        "evil-version": Served(1, altered(manifest, model="evil-version", version=7), data),
        "evil-claim": Served(1, altered(manifest, model="evil-claim", data_bytes=3 << 30), data),
        "evil-gap": Served(1, altered(manifest, model="evil-gap", tensor0={"offset": 8}), data),
        "evil-huge": Served(1, claiming(altered(manifest, model="evil-huge"), 1 << 40), data),
        "evil-big": Served(1, claiming(altered(manifest, model="evil-big"), 256 * MiB), data),  # sound, too big
    }
    invalid = ["evil-name", "evil-model", "evil-version", "evil-claim", "evil-gap"]
    too_large = ["evil-huge", "evil-big"]
    data_dir = tmp_path / "relay" / "data"
    with HostileGrpc(served, listed=[]) as upstream:
        relay = ServeProcess("--relay-from", upstream.target, "--data-dir", str(data_dir),
                             "--max-version-bytes", str(64 * MiB))
        try:
            before = relay.memory()
            upstream.listed = list(served)
            assert relayed(relay, "good") == 1  # what is sound is relayed beside what is not
            upstream.wait_for(pulled_twice(invalid + too_large))
            after = relay.memory()
            counted = metrics(relay)
            held = sorted(m["model"] for m in InferenceClient(relay.target).models())
        finally:
            relay.stop()
    log = relay.proc.stderr.read() if relay.proc.stderr else ""

    assert held == ["good"]
    assert counted["weightsvc_relay_refused_total", "invalid"] >= len(invalid)
    assert counted["weightsvc_relay_refused_total", "too_large"] >= len(too_large)
    assert counted["weightsvc_relay_models_unfollowed", "invalid_name"] == 1
    assert ("Watch", "../../escape") not in upstream.calls  # a listed path is never followed
    for reason in ("model name '../../escape-too' is invalid", "model 'evil-model' was asked for",
                   "version 1 was asked for", "data_bytes is 3221225472, and its 6 tensors take 75716",
                   "starts at byte 8", f"of {1 << 40} bytes is more than the {64 * MiB}",
                   f"of {256 * MiB} bytes is more than the {64 * MiB}", "this relay takes 67108864 bytes: "
                   "--max-version-bytes", "1 with names no model can have"):
        assert reason in log
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(data_dir)]
    assert outside == []
    # The claims (3 GiB, 256 MiB, 1 TiB), each tried again and again, took nothing.
    grown = (after["VmHWM"] - before["VmHWM"]) / MiB
    print(f"relay VmHWM {before['VmHWM'] / MiB:.0f} -> {after['VmHWM'] / MiB:.0f} MiB, RssAnon "
          f"{before['RssAnon'] / MiB:.0f} -> {after['RssAnon'] / MiB:.0f} MiB")
    assert grown < 64


def test_a_relay_follows_at_most_max_models_over_one_connection(
    tmp_path: Path, template: tuple[Manifest, bytes]
) -> None:
    manifest, data = template
    models = [f"m-{i:04d}" for i in range(3000)]
    served = {m: Served(1, altered(manifest, model=m), data) for m in models}
    with HostileGrpc(served) as upstream:
        relay = ServeProcess("--relay-from", upstream.target, "--data-dir", str(tmp_path / "data"),
                             "--max-models", "20")
        try:
            upstream.wait_for(lambda calls: len({m for (method, m), n in calls.items() if method == "Pull"}) >= 20)
            followed = sorted(upstream.models("Watch"))
            for model in followed:
                assert relayed(relay, model) == 1
            lists = upstream.calls["ListModels", ""]
            upstream.wait_for(lambda calls: calls["ListModels", ""] >= lists + 1)  # and it looked again
            connections = established(upstream.port)
            counted = metrics(relay)
            held = sorted(m["model"] for m in InferenceClient(relay.target).models())
            memory = relay.memory()
        finally:
            relay.stop()
    print(f"relay of 3,000 models: {connections} connection(s) to the upstream, {len(held)} followed, "
          f"RssAnon {memory['RssAnon'] / MiB:.0f} MiB")
    assert connections == 1
    assert len(followed) == 20 and held == followed and sorted(upstream.models("Watch")) == followed
    assert counted["weightsvc_relay_models_followed", ""] == 20
    assert counted["weightsvc_relay_models_unfollowed", "max_models"] == 3000 - 20


def test_a_relay_with_a_data_dir_keeps_no_version_per_model_in_its_memory(
    tmp_path: Path, template: tuple[Manifest, bytes]
) -> None:
    """Each followed model's delta base is its committed version's file (its pages the kernel's to
    drop), not the pulled buffer: the relay's own memory does not grow by a version per model."""
    data = os.urandom(16 * MiB)
    tensor = ServedTensor("w", (len(data) // 2,), "BF16", 0, len(data), checksum(data))
    models = [f"m-{i}" for i in range(8)]
    served = {m: Served(1, altered(template[0], model=m, tensors=(tensor,), data_bytes=len(data), aliases=()), data)
              for m in models}
    with HostileGrpc(served, listed=[]) as upstream:
        relay = ServeProcess("--relay-from", upstream.target, "--data-dir", str(tmp_path / "data"))
        try:
            before = relay.memory()["RssAnon"]
            upstream.listed = models
            for model in models:
                assert relayed(relay, model) == 1
            after = relay.memory()["RssAnon"]
        finally:
            relay.stop()
    print(f"relay of 8 x 16 MiB: RssAnon {before / MiB:.0f} -> {after / MiB:.0f} MiB")
    assert after - before < 48 * MiB  # 8 versions held in memory would be 128 MiB


def test_the_data_dir_refuses_every_path_outside_it(tmp_path: Path) -> None:
    """The last check before the disk, whatever named the model: a name that is a path, or a model's
    directory that leads out of the data dir (a symlink), is refused, and nothing is written there."""
    files = VersionFiles(tmp_path / "data")
    for model in ("../../escape", "a/../../b", "..", ".hidden", "a/b", ""):
        with pytest.raises(InvalidArgument, match="is invalid"):
            files.path(model, 1)
    with pytest.raises(InvalidArgument, match="is not a step"):
        files.path("m", -1)
    (tmp_path / "data" / "models").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "data" / "models" / "linked").symlink_to(tmp_path / "outside")
    with pytest.raises(InvalidArgument, match=r"00000000000000000001.safetensors is not under the data dir"):
        files.stage("linked", 1, 100, 100)
    with pytest.raises(InvalidArgument, match="is not under the data dir"):
        files.residual_path("linked", 1)
    assert list((tmp_path / "outside").iterdir()) == []
