"""Versions in an object store (--object-store), against a real S3 server: SeaweedFS on loopback.

Written through on every commit (full every --full-every versions, deltas between, the marker last),
pulled from the store alone bit for bit as a replica serves them, uploads queued while the store is
down, --object-store-required, restore into an empty server, a relay and a watch following the
store, and wrong credentials; a store that lies (delta chains that loop, markers that relabel what
the objects hold, damaged versions and junk beside the sound ones); sharded replicas publishing."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
import torch

from tests.conftest import WEIGHTSVC_CMD, make_masters, serving
from tests.helpers import REDIS_URL, S3_KEY, S3_SECRET, Gate, SeaweedS3, needs_redis, relayed, same_bits, small_step
from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli.status import status_report
from weightsvc.client import Slice
from weightsvc.errors import DataLoss, NotFound, Unauthenticated, Unavailable
from weightsvc.server.server import BackgroundServer
from weightsvc.store.layout import marker_name, object_name

MODEL = "policy"
SELECT = {"layers.0.mlp.up.weight": Slice(0, 10, 50), "embed.weight": Slice(1, 3, 20), "scalar": None}


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    store = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    store.start()
    yield store
    store.stop()


def point_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, secret: str = S3_SECRET) -> None:
    """The AWS_* environment every S3 tool reads, pointed at `endpoint`."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_REGION", "us-east-1")


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch, seaweed: SeaweedS3) -> str:
    """A prefix of the test's own in the bucket, with the environment pointed at the store."""
    point_at(monkeypatch, seaweed.endpoint)
    return f"s3://weights/{uuid.uuid4().hex[:12]}"


def raw_store(seaweed: SeaweedS3):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=seaweed.endpoint, aws_access_key_id=S3_KEY,
                        aws_secret_access_key=S3_SECRET, region_name="us-east-1")


def objects(seaweed: SeaweedS3, url: str) -> dict[str, int]:
    """Name (under the prefix) -> size of every object under the store's prefix."""
    prefix = url.removeprefix("s3://weights/") + "/"
    listed = raw_store(seaweed).list_objects_v2(Bucket="weights", Prefix=prefix).get("Contents", [])
    return {o["Key"].removeprefix(prefix): o["Size"] for o in listed}


def push_steps(srv: BackgroundServer, steps: range, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    masters, out = make_masters(seed), {}
    with LearnerClient(srv.grpc_target) as learner:
        for step in steps:
            masters = small_step(masters, seed=step)
            learner.push(step, masters, model=MODEL)
            out[step] = masters
    return out


def drained(srv: BackgroundServer) -> None:
    publisher = srv.service.publisher
    assert publisher is not None
    srv.call(publisher.drained())


def uploads(srv: BackgroundServer, kind: str) -> float:
    return srv.service.metrics.store_uploads.labels(kind)._value.get()


def test_push_lands_in_the_store_full_every_n_with_deltas_between(store: str, seaweed: SeaweedS3) -> None:
    with serving(object_store=store, full_every=3, retain=10, rounding="sr-sticky") as srv:
        push_steps(srv, range(1, 6))
        drained(srv)
        assert (uploads(srv, "full"), uploads(srv, "delta")) == (2, 3)
    names = objects(seaweed, store)
    kinds = {1: "full", 2: "delta", 3: "delta", 4: "full", 5: "delta"}
    assert set(names) == {marker_name(MODEL, v) for v in kinds} | {object_name(MODEL, v, k) for v, k in kinds.items()}
    # sr-sticky changes few served elements a step: a delta is a fraction of the full version.
    assert names[object_name(MODEL, 2, "delta")] < names[object_name(MODEL, 1, "full")] / 4


def test_a_pull_from_the_store_alone_equals_the_replicas_bit_for_bit(store: str) -> None:
    with serving(object_store=store, full_every=3, retain=10, rounding="sr-sticky") as srv:
        push_steps(srv, range(1, 8))
        drained(srv)
        with InferenceClient(srv.grpc_target) as replica, InferenceClient(store) as remote:
            for version in range(1, 8):  # whole: a full version, or rebuilt from its chain
                same_bits(remote.pull(MODEL, version), replica.pull(MODEL, version))
            whole = remote.last_pull_bytes
            remote.pull(MODEL, 1)
            same_bits(remote.pull(MODEL, 3, base=1), replica.pull(MODEL, 3))  # the deltas after a version held
            assert remote.last_pull_bytes < whole / 2
            # Across a full reset (version 4): the held version 3 is not in 6's chain, so 4 and 5, 6 come.
            same_bits(remote.pull(MODEL, 6, base=3), replica.pull(MODEL, 6))
            for version in (4, 5):  # sliced: of a full version (its tensors' ranges alone), of a delta one
                same_bits(remote.pull(MODEL, version, select=SELECT), replica.pull(MODEL, version, select=SELECT))
            assert remote.manifest(MODEL).version == 7
            assert [v.version for v in remote.versions(MODEL)] == list(range(1, 8))
            assert [m["model"] for m in remote.models()] == [MODEL]
            with pytest.raises(NotFound, match="no version 99"):
                remote.pull(MODEL, 99)


def test_a_version_larger_than_a_part_goes_up_in_parts(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("weightsvc.store.s3.PART_BYTES", 5 << 20)  # S3's smallest part
    big = {"w": torch.randn(3 << 20) * 0.02, "b": torch.randn(1000) * 0.02}  # 6 MiB served + a header: two parts
    with serving(object_store=store) as srv, LearnerClient(srv.grpc_target) as learner:
        learner.push(1, big, model=MODEL)
        drained(srv)
        assert uploads(srv, "full") == 1
        with InferenceClient(store) as remote, InferenceClient(srv.http_url) as replica:
            same_bits(remote.pull(MODEL), replica.pull(MODEL))


def test_store_retention_keeps_the_retained_versions_and_their_chains(store: str, seaweed: SeaweedS3) -> None:
    with serving(object_store=store, full_every=3, retain=2) as srv:
        push_steps(srv, range(1, 7))
        drained(srv)
    # 5 and 6 are retained; 5 is a delta on 4, a full version: 1 to 3 are gone.
    assert sorted(n for n in objects(seaweed, store) if n.endswith(".json")) == [marker_name(MODEL, v)
                                                                                for v in (4, 5, 6)]


def test_commits_go_on_while_the_store_is_down_and_uploads_catch_up(
        store: str, seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(("127.0.0.1", seaweed.port))
    point_at(monkeypatch, f"http://127.0.0.1:{gate.port}")
    try:
        with serving(object_store=store, full_every=2, retain=10) as srv:
            publisher = srv.service.publisher
            assert publisher is not None
            publisher.max_backoff_s = 0.2
            gate.close_gate()
            masters = push_steps(srv, range(1, 4))  # each commit answers while its upload waits
            assert [v.manifest.version for v in srv.service.index.versions(MODEL)] == [1, 2, 3]
            srv.call(publisher.failed())  # tried, and waiting to try again
            assert publisher.queued >= 1 and srv.service.metrics.store_failures._value.get() >= 1
            gate.open_gate()
            drained(srv)
            assert srv.service.metrics.store_queued._value.get() == 0
        point_at(monkeypatch, seaweed.endpoint)
        with InferenceClient(store) as remote:
            assert [v.version for v in remote.versions(MODEL)] == [1, 2, 3]
            pulled = remote.pull(MODEL, 3)
            assert sorted(pulled) == sorted(masters[3])
    finally:
        gate.close()


def test_uploads_a_stop_cut_off_go_up_when_the_server_starts_again(
        store: str, seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gate = Gate(("127.0.0.1", seaweed.port))
    point_at(monkeypatch, f"http://127.0.0.1:{gate.port}")
    try:
        with serving(object_store=store, data_dir=tmp_path) as srv:
            push_steps(srv, range(1, 2))
            drained(srv)
            gate.close_gate()
            push_steps(srv, range(2, 4))  # committed to the data dir, never uploaded
        gate.open_gate()
        with serving(object_store=store, data_dir=tmp_path) as srv:
            drained(srv)
            assert (uploads(srv, "full"), uploads(srv, "delta")) == (0, 2)  # 1 was there: deltas on it
            with InferenceClient(store) as remote, InferenceClient(srv.grpc_target) as replica:
                same_bits(remote.pull(MODEL, 3), replica.pull(MODEL, 3))
    finally:
        gate.close()


def test_a_full_queue_drops_the_oldest_waiting_version(
        store: str, seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    gate = Gate(("127.0.0.1", seaweed.port))
    point_at(monkeypatch, f"http://127.0.0.1:{gate.port}")
    try:
        with serving(object_store=store, object_store_queue=1, retain=10) as srv:
            srv.service.publisher.max_backoff_s = 0.2  # type: ignore[union-attr]
            gate.close_gate()
            with caplog.at_level(logging.WARNING, "weightsvc.store"):
                push_steps(srv, range(1, 4))
            assert srv.service.metrics.store_dropped._value.get() >= 1
            assert "dropped, never to be uploaded" in caplog.text
            gate.open_gate()
            drained(srv)
        point_at(monkeypatch, seaweed.endpoint)
        with InferenceClient(store) as remote, serving() as _:
            versions = [v.version for v in remote.versions(MODEL)]
            assert versions[-1] == 3 and len(versions) < 3
            remote.pull(MODEL, 3)  # a full version (the one before it never reached the store), verified
    finally:
        gate.close()


def test_required_mode_makes_the_stores_errors_the_commits(
        store: str, seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(("127.0.0.1", seaweed.port))
    point_at(monkeypatch, f"http://127.0.0.1:{gate.port}")
    try:
        with serving(object_store=store, object_store_required=True) as srv, \
                LearnerClient(srv.grpc_target) as learner:
            gate.close_gate()
            with pytest.raises(Unavailable, match="object store"):
                learner.push(1, make_masters(), model=MODEL)
            with pytest.raises(NotFound):
                srv.service.index.versions(MODEL)  # nothing committed
            gate.open_gate()
            learner.push(1, make_masters(), model=MODEL)  # the same step again, now that the store is back
            assert uploads(srv, "full") == 1
        point_at(monkeypatch, seaweed.endpoint)
        with InferenceClient(store) as remote:
            assert remote.manifest(MODEL).version == 1
    finally:
        gate.close()


def test_a_torn_upload_is_never_a_version(store: str, seaweed: SeaweedS3) -> None:
    with serving(object_store=store) as srv:
        push_steps(srv, range(1, 3))
        drained(srv)
    s3 = raw_store(seaweed)
    prefix = store.removeprefix("s3://weights/")
    # An object whose marker never came (the upload broke off before it): no version.
    s3.put_object(Bucket="weights", Key=f"{prefix}/{object_name(MODEL, 3, 'full')}", Body=b"partial")
    # A version whose object was cut short after its marker was written: refused by its checksum.
    key = f"{prefix}/{object_name(MODEL, 2, 'delta')}"
    cut = s3.get_object(Bucket="weights", Key=key)["Body"].read()[:-5]
    s3.put_object(Bucket="weights", Key=key, Body=cut)
    with InferenceClient(store) as remote:
        assert [v.version for v in remote.versions(MODEL)] == [1]
        remote.pull(MODEL, 1)
        with pytest.raises(DataLoss, match="commit marker says"):
            remote.pull(MODEL, 2)


def test_an_empty_server_restores_the_retained_versions_from_the_store(store: str, tmp_path: Path) -> None:
    with serving(object_store=store, full_every=2, retain=3, data_dir=tmp_path / "a") as srv:
        push_steps(srv, range(1, 6))
        drained(srv)
        with InferenceClient(srv.grpc_target) as replica:
            before = {v: replica.pull(MODEL, v) for v in (3, 4, 5)}
    with serving(object_store=store, full_every=2, retain=3, data_dir=tmp_path / "b") as srv:
        with InferenceClient(srv.http_url) as restored:  # serving: the restore came first
            assert [v.version for v in restored.versions(MODEL)] == [3, 4, 5]
            for version, tensors in before.items():
                same_bits(restored.pull(MODEL, version), tensors)
        assert uploads(srv, "full") + uploads(srv, "delta") == 0  # nothing written again
        push_steps(srv, range(6, 7))  # and the store goes on from the restored versions: a delta on 5, a full one
        drained(srv)
        assert (uploads(srv, "full"), uploads(srv, "delta")) == (0, 1)


def test_a_relay_and_a_watch_follow_the_store(store: str) -> None:
    with serving(object_store=store) as srv, serving(relay_from=store) as relay:
        push_steps(srv, range(1, 2))
        drained(srv)
        assert relayed(relay, MODEL, None) == 1
        with InferenceClient(store, poll_s=0.1) as remote:  # type: ignore[call-arg]
            watch = remote.watch(MODEL, after=1)
            push_steps(srv, range(2, 3))
            drained(srv)
            assert next(watch).version == 2
        assert relayed(relay, MODEL, 1) == 2
        with InferenceClient(relay.grpc_target) as relayed_copy, InferenceClient(srv.grpc_target) as replica:
            same_bits(relayed_copy.pull(MODEL, 2), replica.pull(MODEL, 2))


def test_wrong_credentials_are_a_clear_error_and_leak_nothing(store: str, seaweed: SeaweedS3, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "not-the-secret-" + uuid.uuid4().hex
    point_at(monkeypatch, seaweed.endpoint, secret=wrong)
    with InferenceClient(store) as remote, pytest.raises(Unauthenticated, match="SignatureDoesNotMatch") as e:
        remote.versions(MODEL)
    assert wrong not in str(e.value)
    with caplog.at_level(logging.DEBUG, "weightsvc"):
        # An empty server restores first: the wrong credentials stop it from starting, named.
        refused = serving(object_store=store)
        with pytest.raises(Unauthenticated, match="SignatureDoesNotMatch"):
            refused.__enter__()
        refused.__exit__(None, None, None)  # (its loop thread, started before the start failed)
        # One with versions of its own starts; its commits go on, and each failed upload is logged.
        point_at(monkeypatch, seaweed.endpoint)
        with serving(object_store=store, data_dir=tmp_path) as srv:
            push_steps(srv, range(1, 2))
        point_at(monkeypatch, seaweed.endpoint, secret=wrong)
        with serving(object_store=store, data_dir=tmp_path) as srv:
            push_steps(srv, range(2, 3))
            assert srv.service.index.latest(MODEL) == 2
            srv.call(srv.service.publisher.failed())  # type: ignore[union-attr]
    assert "SignatureDoesNotMatch" in caplog.text and wrong not in caplog.text


def test_cli_pull_from_the_store(store: str, tmp_path: Path) -> None:
    with serving(object_store=store) as srv:
        push_steps(srv, range(1, 3))
        drained(srv)
        with InferenceClient(srv.grpc_target) as replica:
            expected = replica.pull(MODEL, 2)
    out = tmp_path / "v.safetensors"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([*WEIGHTSVC_CMD, "pull", "--url", store, "--model", MODEL, "-o", str(out),
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    same_bits(load_file(out), expected)


# ---- a store that lies: nothing it holds is trusted ------------------------------------------------

Q, K, W = "layers.1.attn.q.weight", "layers.1.attn.k.weight", "layers.1.mlp.w.weight"


class Tamper:
    """The objects under a test's prefix, read and rewritten behind weightsvc's back, as someone with
    write access to the bucket could."""

    def __init__(self, seaweed: SeaweedS3, url: str) -> None:
        self.s3 = raw_store(seaweed)
        self.prefix = url.removeprefix("s3://weights/")

    def get(self, name: str) -> bytes:
        return bytes(self.s3.get_object(Bucket="weights", Key=f"{self.prefix}/{name}")["Body"].read())

    def put(self, name: str, body: bytes) -> None:
        self.s3.put_object(Bucket="weights", Key=f"{self.prefix}/{name}", Body=body)

    def marker(self, version: int) -> dict:  # type: ignore[type-arg]
        return json.loads(self.get(marker_name(MODEL, version)))  # type: ignore[no-any-return]

    def put_marker(self, version: int, marker: dict) -> None:  # type: ignore[type-arg]
        self.put(marker_name(MODEL, version), json.dumps(marker).encode())


def retagged(marker: dict, change: Callable[[dict], None]) -> dict:  # type: ignore[type-arg]
    """`marker` with `change` applied to its manifest's tensors (a dict by name)."""
    out = copy.deepcopy(marker)
    tensors = {t["name"]: t for t in out["manifest"]["tensors"]}
    change(tensors)
    return out


def swap_names(tensors: dict) -> None:  # type: ignore[type-arg]
    tensors[Q]["name"], tensors[K]["name"] = K, Q


def relabel(tensors: dict) -> None:  # type: ignore[type-arg]
    tensors[W] |= {"dtype": "F32", "shape": [128, 64]}  # as many bytes as BF16 [128, 128]


def huge_shape(tensors: dict) -> None:  # type: ignore[type-arg]
    tensors[Q]["shape"] = [10**30, 128]


SWAPPED = f"tensor ({Q!r}|{K!r}): the commit marker says tensor ({K!r}|{Q!r}) BF16"
RELABELLED = f"tensor {W!r}: the commit marker says tensor {W!r} F32 \\[128, 64\\]"


def square_masters() -> dict[str, torch.Tensor]:
    """`make_masters` and three BF16 [128, 128] tensors once served: two to swap, one to relabel."""
    gen = torch.Generator().manual_seed(3)
    return make_masters() | {name: torch.randn(128, 128, generator=gen) * 0.02 for name in (Q, K, W)}


def test_a_delta_chain_that_loops_is_refused_as_damaged(store: str, seaweed: SeaweedS3) -> None:
    with serving(object_store=store, full_every=10, retain=10) as srv:
        push_steps(srv, range(1, 4))  # 1 full, 2 a delta on 1, 3 a delta on 2
        drained(srv)
        with InferenceClient(srv.grpc_target) as replica:
            first = replica.pull(MODEL, 1)
    tamper = Tamper(seaweed, store)
    two = tamper.marker(2)
    for base in (2, 3):  # 2 on itself; 2 on 3 and 3 on 2
        tamper.put_marker(2, two | {"base": base})
        with InferenceClient(store) as remote:
            same_bits(remote.pull(MODEL, 1), first)
            for version in (2, 3):
                damaged = f"model 'policy' version 2: the store's commit marker .* on version {base}"
                with pytest.raises(DataLoss, match=damaged):
                    remote.pull(MODEL, version)
            assert [v.version for v in remote.versions(MODEL)] == [1]  # 2's marker is damaged, 3 is on it
            assert remote.manifest(MODEL).version == 1
    # A fresh server restores what is sound and sets the rest aside.
    with serving(object_store=store, retain=10) as srv, InferenceClient(srv.grpc_target) as restored:
        assert [v.version for v in restored.versions(MODEL)] == [1]
        same_bits(restored.pull(MODEL, 1), first)
        aside = {d["file"].rsplit("/", 1)[1]: d["reason"] for d in restored.damaged_files()}
        assert sorted(aside) == ["00000000000000000002.json", "00000000000000000003.json"]
        assert "its delta is on version 3" in aside["00000000000000000002.json"]


@pytest.mark.parametrize("version, change, said", [
    (1, swap_names, SWAPPED),
    (1, relabel, RELABELLED),
    (2, swap_names, SWAPPED),
    (2, relabel, RELABELLED),
    (1, huge_shape, f"tensor {Q!r} has dtype 'BF16', shape \\[{10**30}, 128\\]"),
], ids=["names-swapped-full", "relabelled-full", "names-swapped-delta", "relabelled-delta", "huge-shape"])
def test_a_marker_cannot_relabel_what_the_objects_hold(store: str, seaweed: SeaweedS3, version: int,
                                                        change: Callable[[dict], None], said: str) -> None:  # type: ignore[type-arg]
    """A full version's object carries its manifest in its own header, which the marker's checksum
    covers: a marker that names, types or shapes a tensor otherwise is damaged, whatever its tensors'
    checksums say; a delta's tensors are laid out as those of the full version it is built on."""
    masters = square_masters()
    with serving(object_store=store, full_every=10, retain=10) as srv, LearnerClient(srv.grpc_target) as learner:
        learner.push(1, masters, model=MODEL)
        learner.push(2, small_step(masters), model=MODEL)  # a delta on 1
        drained(srv)
    tamper = Tamper(seaweed, store)
    tamper.put_marker(version, retagged(tamper.marker(version), change))
    where = f"model 'policy' version {version}: .*{said}"
    with InferenceClient(store) as remote:
        for select in (None, {Q: None, W: Slice(0, 0, 10)}):
            with pytest.raises(DataLoss, match=where):
                remote.pull(MODEL, version, select=select)
        if version == 2:  # the deltas after a version held
            remote.pull(MODEL, 1)
            with pytest.raises(DataLoss, match=where):
                remote.pull(MODEL, 2, base=1)
    with serving(object_store=store, retain=10) as srv, InferenceClient(srv.grpc_target) as restored:
        aside = {d["file"].removeprefix(f"{store}/"): d["reason"] for d in restored.damaged_files()}
        assert re.search(where, aside[marker_name(MODEL, version)])
        if version == 1:  # and 2, a delta on it
            assert sorted(aside) == [marker_name(MODEL, 1), marker_name(MODEL, 2)]
            with pytest.raises(NotFound, match="set aside at start-up"):
                restored.versions(MODEL)
        else:
            assert sorted(aside) == [marker_name(MODEL, 2)]
            assert [v.version for v in restored.versions(MODEL)] == [1]


def test_restore_sets_the_damaged_aside_and_serves_the_rest(store: str, seaweed: SeaweedS3,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with serving(object_store=store, full_every=2, retain=4) as srv:
        push_steps(srv, range(1, 5))  # 1 full, 2 a delta on 1, 3 full, 4 a delta on 3
        drained(srv)
        with InferenceClient(srv.grpc_target) as replica:
            before = {v: replica.pull(MODEL, v) for v in (1, 3, 4)}
    tamper = Tamper(seaweed, store)
    two = object_name(MODEL, 2, "delta")
    tamper.put(two, tamper.get(two)[:-3])  # cut short after its marker was written
    tamper.put("versions/bad name!/00000000000000000001.json", b"junk")  # no model can have that name
    tamper.put(marker_name("other", 3), tamper.get(marker_name(MODEL, 3)))  # another model's marker
    tamper.put(f"versions/{MODEL}/{9:025d}.json", b"junk")  # a stray marker: 25 digits
    tamper.put(marker_name(MODEL, 5), b"{}")  # and one above the latest
    tamper.put(marker_name(MODEL, 7), tamper.get(marker_name(MODEL, 1)).replace(b'"version": 1,', b'"version": 7,'))
    with InferenceClient(store) as remote:  # a client of the store alone still finds the latest
        assert remote.manifest(MODEL).version == 4
        assert [v.version for v in remote.versions(MODEL)] == [1, 3, 4]
        same_bits(remote.pull(MODEL), before[4])
        assert [m["model"] for m in remote.models()] == [MODEL]
        assert {(d["model"], d["file"].removeprefix(store)) for d in remote.damaged_files()} == {
            *((MODEL, f"/{marker_name(MODEL, v)}") for v in (2, 5, 7)), ("other", f"/{marker_name('other', 3)}"),
            ("bad name!", "/versions/bad name!/")}
    with caplog.at_level(logging.ERROR, "weightsvc.store"), serving(object_store=store, full_every=2, retain=4) as srv:
        said = [r.getMessage() for r in caplog.records if "is damaged, set aside" in r.getMessage()]
        assert len(said) == 5 and all(store in line for line in said), said  # each named in the log
        with InferenceClient(srv.http_url) as restored:  # serving: the sound versions came back
            assert [v.version for v in restored.versions(MODEL)] == [1, 3, 4]
            for version, tensors in before.items():
                same_bits(restored.pull(MODEL, version), tensors)
        report = status_report(srv.grpc_target, None, None, None, 10)
        aside = {(d["model"], d["file"].removeprefix(store)): d["reason"] for d in report["damaged_files"]}
        assert sorted(aside) == [("bad name!", "/versions/bad name!/"), ("other", f"/{marker_name('other', 3)}"),
                                 *((MODEL, f"/{marker_name(MODEL, v)}") for v in (2, 5, 7))]
        assert "commit marker says" in aside[(MODEL, f"/{marker_name(MODEL, 2)}")]
        assert "it says model 'policy' version 3" in aside[("other", f"/{marker_name('other', 3)}")]
        assert "is missing; its commit marker says" in aside[(MODEL, f"/{marker_name(MODEL, 7)}")]
        assert srv.service.metrics.damaged_files._value.get() == 5
        # And the store goes on: 5 (its damaged marker replaced) full, 6 a delta on it; retention as ever.
        push_steps(srv, range(5, 7))
        drained(srv)
        assert (uploads(srv, "full"), uploads(srv, "delta")) == (1, 1)
    with InferenceClient(store) as remote:  # (7's marker stays, for someone to look at; its object never came)
        assert [v.version for v in remote.versions(MODEL)] == [3, 4, 5, 6]


# ---- sharded replicas ------------------------------------------------------------------------------


def uploaded(srv: BackgroundServer) -> float:
    return uploads(srv, "full") + uploads(srv, "delta")


@needs_redis
def test_sharded_replicas_publish_each_version_once_and_a_fresh_cluster_restores(
        store: str, seaweed: SeaweedS3, redis_prefix: str) -> None:
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "object_store": store, "full_every": 2,
              "retain": 3}
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1, \
            serving(**shared, replica_id="r2") as r2:
        replicas = (r0, r1, r2)
        push_steps(r1, range(1, 5))  # 1 full, 2 a delta on 1, 3 full, 4 a delta on 3
        for srv in replicas:
            drained(srv)
        parts = r0.service.index.get(MODEL, 4).manifest.parts
        assert len({h for p in parts for h in p.sources}) == 3  # every replica holds a part of each version
        # Once, by r0, the first of the replicas that hold its parts: gathered whole, a delta on the one before.
        assert [(uploads(srv, "full"), uploads(srv, "delta")) for srv in replicas] == [(2, 2), (0, 0), (0, 0)]
        with InferenceClient(store) as remote, InferenceClient(r2.grpc_target) as replica:
            assert [v.version for v in remote.versions(MODEL)] == [1, 2, 3, 4]
            before = {v: replica.pull(MODEL, v) for v in (2, 3, 4)}
            for version, tensors in before.items():
                same_bits(remote.pull(MODEL, version), tensors)
            assert remote.manifest(MODEL).parts == ()  # served whole from the store
    # A fresh cluster (an empty registry, no data dirs) brings the retained versions back from the store.
    fresh = shared | {"redis_prefix": f"{redis_prefix}:fresh"}
    with serving(**fresh, replica_id="r0") as r0, serving(**fresh, replica_id="r1") as r1, \
            serving(**fresh, replica_id="r2") as r2:
        replicas = (r0, r1, r2)
        for srv in replicas:
            with InferenceClient(srv.grpc_target) as restored:
                assert [v.version for v in restored.versions(MODEL)] == [2, 3, 4]
                same_bits(restored.pull(MODEL, 4), before[4])
        masters = push_steps(r2, range(5, 6), seed=1)  # the cluster goes on, sharded again
        for srv in replicas:
            drained(srv)
        assert [uploaded(srv) for srv in replicas] == [1, 0, 0]
        with InferenceClient(store) as remote, InferenceClient(r1.http_url) as replica:
            assert [v.version for v in remote.versions(MODEL)] == [3, 4, 5]
            same_bits(remote.pull(MODEL, 5), replica.pull(MODEL, 5))
            assert sorted(remote.pull(MODEL, 5)) == sorted(masters[5])
