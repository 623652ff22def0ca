"""Sharded replicas: several servers on one Redis registry, each holding the tensors it owns by
rendezvous hashing. The clients split pushes and gather pulls; a version is visible everywhere once
every owner has its part, and nowhere if one fails. In-process replicas first, then replica
processes that are killed and restarted."""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import safetensors.torch
import torch

from tests.conftest import ServeProcess, make_masters, serving
from tests.helpers import REDIS_URL, needs_redis, push_ranks, relayed, served_file
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import Shard
from weightsvc.errors import FailedPrecondition
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.topology import assign
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

pytestmark = needs_redis

REPLICAS = ("r0", "r1", "r2")


def _pending_parts(prefix: str) -> list[bytes]:
    return list(redis.Redis.from_url(REDIS_URL).scan_iter(f"{prefix}:*pending*"))


def _no_parts_left(prefix: str, timeout: float = 20) -> bool:
    """The owners that had their parts in withdraw them once the learner's cancel reaches them (a
    moment after its push raised); Redis is polled, as there is nothing in it to wait on."""
    deadline = time.monotonic() + timeout
    while _pending_parts(prefix) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _pending_parts(prefix)


def _steps(masters: dict[str, torch.Tensor], count: int) -> Iterator[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(count):
        masters = {n: t + 3e-4 * torch.randn(t.shape, generator=gen) for n, t in masters.items()}
        yield masters


@pytest.mark.parametrize("replication", [1, 2])
def test_sharded_push_and_pull_equal_one_server_bit_for_bit(
    redis_prefix: str, model: str, tmp_path: Path, replication: int
) -> None:
    """Each tensor on one replica, or on two (each group of tensors then pulled from either holder)."""
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "rounding": "ef", "replication": replication}
    gen = torch.Generator().manual_seed(5)
    masters = make_masters() | {f"layers.{i}.mlp.down.weight": torch.randn(64, 40, generator=gen) for i in range(1, 5)}
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1, \
            serving(**shared, replica_id="r2") as r2, serving(rounding="ef") as alone:
        replicas = (r0, r1, r2)
        topology = InferenceClient(r0.grpc_target).topology()
        assert [r.id for r in topology] == list(REPLICAS)
        owned = assign(masters, topology, replication)
        assert len(owned) == 3, owned  # every replica owns some of these tensors
        with LearnerClient(r1.grpc_target) as learner, LearnerClient(alone.grpc_target) as single:
            # ef across steps: each owner keeps the residual of its own tensors.
            for step, state in enumerate(_steps(masters, 3)):
                info = learner.push(step, state, model)
                plain = single.push(step, state, model)
                assert (info.version, info.data_bytes >= plain.data_bytes) == (step, True)
        for srv in replicas:  # each replica holds its own part(s), and the same manifest
            held = srv.service.index.get(model, 2)
            whole = held.manifest
            me = srv.service.parts.replica_id
            if replication == 1:
                assert [p.owner for p in whole.parts] == list(REPLICAS)
            else:  # a part per group of tensors with the same two owners
                assert all(len(p.holders) == 2 for p in whole.parts)
                assert [p.holders for p in whole.parts] == sorted(p.holders for p in whole.parts)
            mine = [p for p in whole.parts if me in p.sources]
            assert [(s.start, s.nbytes) for s in held.spans] == [(p.offset, p.nbytes) for p in mine]
            assert {t.name for t in whole.tensors for p in mine if p.offset <= t.offset < p.offset + p.nbytes} == set(
                owned[me]
            )
        manifests = {json.dumps(InferenceClient(s.grpc_target).manifest(model, 2).to_dict()) for s in replicas}
        assert len(manifests) == 1
        expected = InferenceClient(alone.grpc_target).pull(model, 2)
        for srv in replicas:  # any replica is a way in: the client gathers the parts from their owners
            with InferenceClient(srv.grpc_target) as puller:
                pulled = puller.pull(model, 2)
                assert puller.last_pull_bytes == puller.manifest(model, 2).data_bytes - _padding(whole)
            assert pulled.keys() == expected.keys()
            for name in expected:
                assert torch.equal(pulled[name].view(torch.int16), expected[name].view(torch.int16)), name
            assert [v.version for v in InferenceClient(srv.grpc_target).versions(model)] == [0, 1, 2]
        # Watch at any replica sees each version once every part is in.
        with InferenceClient(r2.grpc_target) as watcher:
            assert [next(iter(watcher.watch(model, after=1))).version] == [2]
        # A relay of the sharded replicas gathers each version and serves it whole, over HTTP too.
        with serving(relay_from=r0.grpc_target) as relay:
            assert relayed(relay, model, after=1) == 2
            relay_file = served_file(relay, model, 2, tmp_path / "relayed.safetensors")
            with urllib.request.urlopen(f"{relay.http_url}/v1/models/{model}/versions/2/safetensors") as resp:
                assert resp.read() == relay_file
            relayed_bits = InferenceClient(relay.http_url).pull(model, 2)
            assert all(torch.equal(relayed_bits[n], expected[n]) for n in expected)
            # Its file has no parts in its header: another ETag, so a Range resume never splices the two.
            head = {"Range": "bytes=0-7"}
            etags = {urllib.request.urlopen(urllib.request.Request(f"{srv.http_url}/v1/models/{model}/versions/2/"
                                                                   "safetensors", headers=head)).headers["etag"]
                     for srv in (r0, r1, relay)}
            assert len(etags) == 2
        # Over HTTP too, the client gathers the parts (by Range, from each owner).
        for srv in replicas:
            over_http = InferenceClient(srv.http_url).pull(model, 2)
            assert all(torch.equal(over_http[n], expected[n]) for n in expected)
        # Parts follow each other without gaps, so the gathered file is valid safetensors, also when a part
        # ends at an odd byte (fp8) and the next one's tensors start unaligned.
        with LearnerClient(r2.grpc_target) as learner:
            learner.push(3, masters, model, format="fp8_e4m3", rounding="sr")
        fp8 = InferenceClient(r1.grpc_target).pull_file(tmp_path / "v3.safetensors", model, 3)
        assert any(p.offset % 4 for p in fp8.parts)
        loaded = safetensors.torch.load_file(tmp_path / "v3.safetensors")
        for name, t in InferenceClient(r0.http_url).pull(model, 3).items():
            assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
        # A replica serves the header and its own part; asked for the whole file, it says who holds what.
        url = f"{r2.http_url}/v1/models/{model}/versions/2/safetensors"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url)
        assert err.value.code == 409
        first = f"({'/'.join(whole.parts[0].sources)} [0, {whole.parts[0].nbytes})"
        assert f"sharded over replicas that each hold a part of its data section {first}" in err.value.read().decode()
        # No delta of a version of parts: the client pulls the parts from their owners.
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{r2.http_url}/v1/models/{model}/versions/2/delta?base=1")
        assert err.value.code == 409
        error = json.loads(err.value.read())["error"]
        assert error == {"code": "FAILED_PRECONDITION", "message": f"model {model!r} version 2: no delta against "
                         "base 1: the version is sharded over replicas; pull the whole version"}


def _padding(manifest: Manifest) -> int:
    """Bytes between parts (each starts 8-byte aligned): no replica sends them."""
    return sum(b.offset - (a.offset + a.nbytes) for a, b in itertools.pairwise(manifest.parts))


def _part_push(model: str, owners: list[str]) -> Iterator[pb.PushRequest]:
    """A replica's part as the learner client sends it: one tensor, declared owners."""
    spec = pb.TensorSpec(name="w", shape=[2], dtype="F32")
    yield pb.PushRequest(header=pb.PushHeader(model=model, step=4, owners=owners, tensors=[spec]))
    yield pb.PushRequest(chunk=pb.Chunk(tensor="w", offset=0, data=torch.ones(2).numpy().tobytes()))
    yield pb.PushRequest(commit=pb.PushCommit())


def test_a_part_whose_owners_never_join_is_withdrawn(redis_prefix: str, model: str) -> None:
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "push_rank_timeout_s": 0.5}
    with serving(**shared, replica_id="r0") as r0:
        with grpc.insecure_channel(r0.grpc_target) as ch, pytest.raises(grpc.RpcError) as err:
            pb_grpc.WeightServiceStub(ch).Push(_part_push(model, ["r0", "gone"]), timeout=30)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "not every owner of ['gone', 'r0'] committed its part within 0.5 s" in err.value.details()
        assert _pending_parts(redis_prefix) == []
        assert r0.service.index.models() == []
        # A replica that is not among the owners refuses the part.
        with grpc.insecure_channel(r0.grpc_target) as ch, pytest.raises(grpc.RpcError) as err:
            pb_grpc.WeightServiceStub(ch).Push(_part_push(model, ["r1", "r2"]), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "this server is replica 'r0', not one of the owners ['r1', 'r2']" in err.value.details()


def test_a_waiting_part_holds_back_its_model_until_the_learner_gives_up(redis_prefix: str, model: str) -> None:
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "push_rank_timeout_s": 60}
    with serving(**shared, replica_id="r0") as r0, grpc.insecure_channel(r0.grpc_target) as ch:
        waiting = pb_grpc.WeightServiceStub(ch).Push.future(_part_push(model, ["r0", "r1"]), timeout=60)
        deadline = time.monotonic() + 20
        while not _pending_parts(redis_prefix) and time.monotonic() < deadline:  # Redis: nothing to wait on
            time.sleep(0.02)
        assert _pending_parts(redis_prefix)
        # What would build on the waiting version is refused at once, not queued behind it.
        refused = "is waiting for the other owners' parts"
        with LearnerClient(r0.grpc_target) as learner, pytest.raises(FailedPrecondition, match=refused):
            learner.push(5, {"w": torch.ones(2)}, model)
        # The learner gives up (another owner failed): the part is withdrawn at once, not after 60 s.
        waiting.cancel()
        assert _no_parts_left(redis_prefix, timeout=10)
        assert r0.service.index.models() == []


def _replica(prefix: str, replica_id: str, data_dir: Path, env: dict[str, str] | None = None,
             replication: int = 1, rounding: str = "sr") -> ServeProcess:
    return ServeProcess("--redis-url", REDIS_URL, "--redis-prefix", prefix, "--replica-id", replica_id,
                        "--data-dir", str(data_dir / replica_id), "--push-rank-timeout-s", "30",
                        "--replication", str(replication), "--retain", "8", "--rounding", rounding,
                        env=env)


@pytest.mark.parametrize("rounding", ["sr", "ef"])
def test_replication_two_survives_any_one_replica_killed(
    redis_prefix: str, model: str, tmp_path: Path, rounding: str
) -> None:
    """Three replica processes, each tensor on two of them. One replica at a time is SIGKILLed: before
    a push, while the learner streams to it, after a push (the learner's own way in), and while a
    puller reads from it. Every push goes on (the learner leaves the dead replica out and pushes
    again), every committed version stays pullable bit for bit from every live replica, and a
    replica that returns catches up with what was committed while it was down, before it takes
    part in a push (with ef, its owners decide from the same latest version which residuals go on).
    sr serves one server's bits; ef's residuals of the tensors that move start afresh, so its
    versions are checked the same on every replica."""
    prefix = redis_prefix
    procs = {r: _replica(prefix, r, tmp_path, replication=2, rounding=rounding) for r in REPLICAS}
    states = list(_steps(make_masters(scale=0.05), 5))
    versions: list[int] = []
    expected: dict[int, dict[str, torch.Tensor]] = {}

    def same_bits(proc: ServeProcess, version: int) -> None:
        with InferenceClient(proc.target) as puller:
            got = puller.pull(model, version)
        assert got.keys() == expected[version].keys()
        for name, t in expected[version].items():
            assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), (version, name)

    def live() -> list[ServeProcess]:
        return [p for p in procs.values() if p.proc.poll() is None]

    def every_version_from(replicas: list[ServeProcess]) -> None:
        for proc in replicas:
            for v in versions:
                same_bits(proc, v)

    def kill_after(replica_id: str, nbytes: int) -> Callable[[int], None]:
        """A progress callback that SIGKILLs the replica once `nbytes` have moved."""
        moved = 0

        def progress(n: int) -> None:
            nonlocal moved
            moved += n
            if moved > nbytes and procs[replica_id].proc.poll() is None:
                procs[replica_id].proc.kill()

        return progress

    def restart(replica_id: str) -> ServeProcess:
        return _replica(prefix, replica_id, tmp_path, replication=2, rounding=rounding)

    def pushed(learner: LearnerClient, step: int, **kwargs: Any) -> None:
        assert learner.push(step, states[step - 1], model, **kwargs).version == step
        versions.append(step)
        if rounding == "ef":  # the bits as the first replica that answers serves them
            expected[step] = InferenceClient(live()[0].target).pull(model, step)

    try:
        if rounding == "sr":
            with serving(retain=8) as alone, LearnerClient(alone.grpc_target) as single:
                for step, state in enumerate(states, 1):  # the bits one server serves, the reference
                    single.push(step, state, model)
                expected.update({v: InferenceClient(alone.grpc_target).pull(model, v) for v in range(1, 6)})
        with LearnerClient(procs["r0"].target) as learner:
            pushed(learner, 1)
            whole = InferenceClient(procs["r1"].target).manifest(model, 1)
            assert all(len(p.holders) == 2 for p in whole.parts)
            assert {h for p in whole.parts for h in p.holders} == set(REPLICAS)

            procs["r1"].kill()  # before a push: its registration is still there; the learner leaves it out
            pushed(learner, 2)
            every_version_from(live())

            # Back, r1 catches up before it takes part in a push: the next one, at once, with r2
            # killed while the learner streams to it.
            procs["r1"] = restart("r1")
            pushed(learner, 3, progress=kill_after("r2", 100_000))
            procs["r2"].died()
            with InferenceClient(procs["r1"].target) as watcher:
                assert next(iter(watcher.watch(model, after=1))).version == 2
            every_version_from(live())

            procs["r2"] = restart("r2")
            procs["r0"].kill()  # after a push: the learner's way in is gone; it asks the others
            pushed(learner, 4)
            every_version_from(live())

        # While a puller reads from it: the parts it held come from their other holder.
        procs["r0"] = restart("r0")
        with LearnerClient(procs["r2"].target) as learner:
            pushed(learner, 5)
        with InferenceClient(procs["r2"].target) as puller:
            pulled = puller.pull(model, 5, progress=kill_after("r1", 50_000))
        assert procs["r1"].died() != 0
        assert all(torch.equal(pulled[n].view(torch.int16), t.view(torch.int16)) for n, t in expected[5].items())

        procs["r1"] = restart("r1")
        every_version_from(list(procs.values()))  # all back: every version, bit for bit, from each
    finally:
        for proc in procs.values():
            if proc.proc.poll() is None:
                proc.kill()


def test_a_push_made_again_after_a_replica_restart_is_idempotent(redis_prefix: str, model: str) -> None:
    """A replica SIGKILLed without a data dir comes back holding none of its part of a version: it shows
    the version (clients fetch from the replicas that hold it), and has no part digest of its own to
    compare a push of it with. The same masters pushed again are the same version (it used to answer
    "already committed with different content", comparing the part's digest with the whole version's):
    pushed with another rounding the replica serves on as it was; pushed as before it holds its part
    again, and every replica serves the version bit for bit."""
    def replica(replica_id: str) -> ServeProcess:  # replication 1: each tensor on its owner alone
        return ServeProcess("--redis-url", REDIS_URL, "--redis-prefix", redis_prefix, "--replica-id", replica_id,
                            "--push-rank-timeout-s", "30", "--replication", "1", "--rounding", "sr")

    procs = {r: replica(r) for r in REPLICAS}
    state = make_masters(scale=0.05)
    try:
        with LearnerClient(procs["r0"].target) as learner:
            first = learner.push(1, state, model)
        with InferenceClient(procs["r0"].target) as puller:
            committed, expected = puller.manifest(model, 1), puller.pull(model, 1)
        assert {p.owner for p in committed.parts} == set(REPLICAS)
        procs["r1"].kill()
        procs["r1"] = replica("r1")  # ready once it has caught up: it shows version 1, holding none of it
        with LearnerClient(procs["r1"].target) as learner:
            again = learner.push(1, state, model, rounding="rtn")  # other bytes of the same masters
            assert (again.version, again.created, again.rounding) == (1, False, "sr")
            assert not learner.push(1, state, model).created
        for proc in procs.values():
            with InferenceClient(proc.target) as puller:
                assert puller.manifest(model, 1) == committed
                got = puller.pull(model, 1)
            assert got.keys() == expected.keys()
            for name, t in expected.items():
                assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), (name, proc.target)
        assert first.created
    finally:
        for proc in procs.values():
            if proc.proc.poll() is None:
                proc.kill()


def test_learner_ranks_push_to_sharded_replicas(redis_prefix: str, model: str) -> None:
    """FSDP-style ranks, each with whole tensors and a shard of one, over three replicas: each rank
    sends every replica its share (possibly nothing); the version equals a one-rank push to one server."""
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix}
    state = make_masters(seed=3)
    split = "layers.0.mlp.up.weight"
    others = [n for n in state if n != split]
    flat, shape = state[split].reshape(-1), tuple(state[split].shape)
    ranks: list[dict[str, torch.Tensor | Shard]] = [
        {n: state[n] for n in others[:2]} | {split: Shard(flat[:5000], 0, shape)},
        {n: state[n] for n in others[2:4]} | {split: Shard(flat[5000:], 5000, shape)},
        {n: state[n] for n in others[4:]},
    ]
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1"), \
            serving(**shared, replica_id="r2"), serving() as alone:
        for f in push_ranks(r0.grpc_target, 1, ranks, model):
            assert f.result().tensor_count == len(state)
        with LearnerClient(alone.grpc_target) as single:
            single.push(1, state, model)
        expected = InferenceClient(alone.grpc_target).pull(model, 1)
        pulled = InferenceClient(r0.grpc_target).pull(model, 1)
        assert pulled.keys() == expected.keys()
        assert all(torch.equal(pulled[n], expected[n]) for n in expected)


def test_tied_weights_over_sharded_replicas_and_ranks(redis_prefix: str, model: str) -> None:
    """A tie declared by name on every rank reaches the replica that owns its tensor, whichever rank
    holds it: every replica serves the alias, bit for bit the tensor, as one server does."""
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix}
    state = make_masters(seed=4)
    tied = {"lm_head.weight": "embed.weight"}
    names = list(state)
    ranks: list[dict[str, torch.Tensor | Shard]] = [{n: state[n] for n in names[:3]}, {n: state[n] for n in names[3:]}]
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1, \
            serving() as alone:
        for f in push_ranks(r0.grpc_target, 1, ranks, model, tied=tied):
            f.result()
        with LearnerClient(alone.grpc_target) as single:
            single.push(1, state, model, tied=tied)
        expected = InferenceClient(alone.grpc_target).pull(model, 1)
        for replica in (r0, r1):
            pulled = InferenceClient(replica.grpc_target).pull(model, 1)
            assert pulled["lm_head.weight"] is pulled["embed.weight"]
            assert pulled.keys() == expected.keys()
            assert all(torch.equal(pulled[n], expected[n]) for n in expected)


def test_a_sharded_deployment_refuses_a_push_over_http_clearly(redis_prefix: str, model: str) -> None:
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix}
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1"), \
            LearnerClient(r0.http_url) as learner:
        with pytest.raises(FailedPrecondition, match=r"the deployment has 2 replicas; a sharded push goes over gRPC"):
            learner.push(1, make_masters(), model=model)
        assert model not in {m["model"] for m in InferenceClient(r0.http_url).models()}
