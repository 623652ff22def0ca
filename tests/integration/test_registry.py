"""The registry contract, run against the embedded registry and against real Redis; then the
service on Redis: shared state, and what happens when Redis goes away and comes back."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import make_masters, serving
from tests.helpers import REDIS_URL, PrivateRedis, needs_redis
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import AlreadyExists, DataLoss, FailedPrecondition, Unavailable
from weightsvc.protocol.mismatch import MAX_TOKENS, RolloutMismatch
from weightsvc.protocol.topology import Replica
from weightsvc.server.server import BackgroundServer
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.redis import RedisRegistry
from weightsvc.service.replicas.registry import MismatchRecord, Registry, combined_digest, record_digest


def manifest(version: int) -> str:
    return json.dumps({"model": "m", "version": version})


async def test_commit_rules(registry: Registry) -> None:
    assert (await registry.commit("m", 5, "d5", manifest(5), retain=4)).created
    assert not (await registry.commit("m", 5, "d5", manifest(5), retain=4)).created  # idempotent
    with pytest.raises(AlreadyExists, match=r"model 'm' version 5 is already committed with different content "
                                            r"\(master digest d5, pushed other\)"):
        await registry.commit("m", 5, "other", manifest(5), retain=4)
    with pytest.raises(FailedPrecondition, match=r"model 'm': step 3 is not above the latest version 5"):
        await registry.commit("m", 3, "d3", manifest(3), retain=4)
    assert await registry.versions("m") == [5]
    assert json.loads(await registry.manifest("m", 5) or "") == {"model": "m", "version": 5}
    assert await registry.manifest("m", 4) is None
    assert await registry.models() == ["m"]
    assert await registry.versions("unknown") == []


async def test_mismatch_records_add_up_and_follow_retention(registry: Registry) -> None:
    a, b = MismatchRecord(10, 1.0, 0.1, 2.0, step=3), MismatchRecord(30, 0.5, 1e-7, 0.0)
    totals = await registry.add_mismatch("m", {4: a, 5: b}, keep=[4, 5])
    assert totals == {4: a, 5: b}
    totals = await registry.add_mismatch("m", {5: MismatchRecord(1, 0.25, 1e-9, 1.0, step=7)}, keep=[4, 5])
    assert totals[5].tokens == 31 and totals[5].step == 7
    assert totals[5].k3_kl == pytest.approx(1e-7 + 1e-9, rel=1e-15)  # small sums keep their digits
    means = totals[5].mismatch()  # (Redis adds in long doubles: the last bit may differ)
    expected = RolloutMismatch(31, 0.75 / 31, (1e-7 + 1e-9) / 31, 1 / 31)
    assert means.tokens == expected.tokens
    for field in ("mean_abs_logp_delta", "k3_kl", "outside_band"):
        assert getattr(means, field) == pytest.approx(getattr(expected, field), rel=1e-15), field
    assert await registry.mismatch("m") == {4: a, 5: totals[5]}
    await registry.add_mismatch("m", {6: a}, keep=[5, 6])  # version 4 retired: its record goes
    assert (await registry.mismatch("m")).keys() == {5, 6}
    assert await registry.mismatch("other") == {}


async def test_a_report_past_what_a_record_holds_adds_nothing(registry: Registry) -> None:
    """All or nothing: a report that would take a version's totals past MAX_TOKENS tokens or a finite sum
    is refused whole (its other versions too), and the totals stay as they were, readable."""
    held = {1: MismatchRecord(100, 1.0, 1e308, 5.0, step=1), 2: MismatchRecord(MAX_TOKENS - 10, 2.0, 0.5, 0.0)}
    await registry.add_mismatch("m", held, keep=[1, 2])
    fine = MismatchRecord(10, 0.5, 0.5, 1.0, step=2)
    for too_much, which in (({1: MismatchRecord(10, 0.5, 1e308, 0.0, step=2)}, [1]),  # k3 sum past a double
                            ({2: MismatchRecord(11, 0.5, 0.5, 0.0)}, [2]),  # one token past MAX_TOKENS
                            ({1: MismatchRecord(2**63 - 1, 0.0, 0.0, 0.0)}, [1]),  # past Redis's integers too
                            ({3: fine, 1: MismatchRecord(1, float("inf"), 0.0, 0.0)}, [1])):
        refused = (rf"model 'm': the report would take the mismatch totals of version\(s\) {re.escape(str(which))} "
                   rf"past {MAX_TOKENS} tokens or past a finite sum; nothing of this report was recorded")
        with pytest.raises(FailedPrecondition, match=refused):
            await registry.add_mismatch("m", too_much, keep=[1, 2, 3])
    assert await registry.mismatch("m") == held
    totals = await registry.add_mismatch("m", {2: MismatchRecord(10, 0.5, 0.5, 0.0)}, keep=[1, 2])  # to the bound
    assert totals[2].tokens == MAX_TOKENS
    assert (await registry.mismatch("m"))[2].mismatch().tokens == MAX_TOKENS


async def test_mismatch_records_of_big_version_numbers_are_kept(registry: Registry) -> None:
    a = MismatchRecord(10, 1.0, 0.1, 2.0)
    big = [10**15, 10**18 - 1]  # (as numbers, Lua writes them 1e+15 and 1e+18)
    await registry.add_mismatch("m", {big[0]: a}, keep=big[:1])
    await registry.add_mismatch("m", {big[1]: a}, keep=big)
    assert await registry.mismatch("m") == {big[0]: a, big[1]: a}


async def test_retention_keeps_the_newest_versions(registry: Registry) -> None:
    evicted = [(await registry.commit("m", v, f"d{v}", manifest(v), retain=2)).evicted for v in (1, 2, 3, 4)]
    assert evicted == [(), (), (1,), (2,)]
    assert await registry.versions("m") == [3, 4]
    assert await registry.manifest("m", 1) is None


async def test_concurrent_commits_of_one_step_have_one_winner(registry: Registry) -> None:
    results = await asyncio.gather(
        *(registry.commit("m", 1, f"digest-{i}", manifest(1), retain=4) for i in range(8)), return_exceptions=True
    )
    assert sum(not isinstance(r, BaseException) and r.created for r in results) == 1
    assert all(isinstance(r, AlreadyExists) for r in results if isinstance(r, BaseException))


async def test_events_give_retained_versions_then_each_new_one(registry: Registry) -> None:
    await registry.commit("m", 1, "d1", manifest(1), retain=4)
    await registry.commit("m", 2, "d2", manifest(2), retain=4)
    seen: list[int] = []
    done = asyncio.Event()

    async def watch() -> None:
        async for v in registry.events("m", after=1):
            seen.append(v)
            if v == 4:
                done.set()
                return

    task = asyncio.create_task(watch())
    await registry.commit("m", 3, "d3", manifest(3), retain=4)
    await registry.commit("m", 4, "d4", manifest(4), retain=4)
    await asyncio.wait_for(done.wait(), 10)
    await task
    assert seen == [2, 3, 4]


@needs_redis
async def test_an_idle_watch_outlives_the_socket_timeout(redis_prefix: str) -> None:
    """Nothing commits for three socket timeouts: the events iterator waits on, it does not fail."""
    registry = RedisRegistry(REDIS_URL, prefix=redis_prefix, socket_timeout=0.5)
    try:
        events = registry.events("m", -1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(events), timeout=1.5)
        await registry.commit("m", 1, "d1", manifest(1), retain=4)
        assert await anext(registry.events("m", 0)) == 1
    finally:
        await registry.close()


async def test_acks(registry: Registry) -> None:
    now = time.time()
    assert await registry.ack("m", "pod-a", 3, now, "token:a", 60.0)
    assert await registry.ack("m", "pod-b", 2, now + 1, "token:b", 60.0)
    assert await registry.ack("m", "pod-a", 4, now + 2, "token:a", 60.0)
    assert not await registry.ack("m", "pod-a", 5, now + 3, "token:b", 60.0)  # pod-a is token a's
    assert await registry.acks("m") == {"pod-a": (4, now + 2), "pod-b": (2, now + 1)}


async def test_acks_are_bounded_and_expire(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{type(registry).__module__}.ACKS_KEPT", 3)
    now = time.time()
    for i in range(5):
        assert await registry.ack("m", f"pod-{i}", 1, now + i, "token:a", 60.0)
    assert sorted(await registry.acks("m")) == ["pod-2", "pod-3", "pod-4"]  # the newest 3
    assert await registry.ack("m", "late", 1, now + 100, "token:a", 60.0)  # the others are silent for 60 s
    assert sorted(await registry.acks("m")) == ["late"]
    assert await registry.ack("m", "pod-0", 1, now + 101, "token:b", 60.0)  # forgotten: anyone's again


# ---- the service on Redis ----------------------------------------------------------------------


@needs_redis
def test_service_on_redis_commits_watches_and_acks_through_it(model: str) -> None:
    prefix_keys = f"weightsvc:{{{model}}}:*"
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(prefix_keys):
        client.delete(key)
    with serving(redis_url=REDIS_URL) as srv, LearnerClient(srv.grpc_target) as learner:
        learner.push(1, make_masters(), model=model)
        with InferenceClient(srv.grpc_target) as puller:
            assert next(iter(puller.watch(model))).version == 1
            puller.ack(model, 1, "pod-0")
            digest = puller.manifest(model, 1).master_digest
        assert [int(v) for v in client.zrange(f"weightsvc:{{{model}}}:versions", 0, -1)] == [1]
        assert json.loads(client.hget(f"weightsvc:{{{model}}}:manifests", "1") or b"")["master_digest"] == digest
        assert json.loads(client.hget(f"weightsvc:{{{model}}}:acks", "pod-0") or b"")[0] == 1
    for key in client.scan_iter(prefix_keys):
        client.delete(key)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH: the test starts and kills a Redis of its own")
    r = PrivateRedis(tmp_path, persist=True)
    r.start()
    yield r
    r.kill()


def test_losing_redis_keeps_serving_refuses_pushes_and_recovers(
    private_redis: PrivateRedis, tmp_path: Path, model: str
) -> None:
    masters = make_masters()
    with serving(redis_url=private_redis.url, data_dir=tmp_path / "data") as srv:
        learner, puller = LearnerClient(srv.grpc_target), InferenceClient(srv.grpc_target)
        learner.push(1, masters, model=model)
        private_redis.kill()
        # Committed versions keep being served; a push fails with UNAVAILABLE and leaves nothing.
        assert puller.pull(model, 1)["embed.weight"].shape == (97, 64)
        with pytest.raises(Unavailable, match=rf"registry {private_redis.url} unreachable while committing model "
                                              rf"'{model}' version 2"):
            learner.push(2, masters, model=model)
        assert [v.version for v in puller.versions(model)] == [1]
        assert sorted(p.name for p in (tmp_path / "data" / "models" / model).iterdir()) == [f"{1:020d}.safetensors"]
        puller.ack(model, 1, "pod-0")  # acks still work (this server's view)
        private_redis.start()
        assert learner.push(2, masters, model=model).version == 2  # redis-py reconnects by itself
        assert [v.version for v in puller.versions(model)] == [1, 2]


def test_restart_drops_a_version_the_registry_never_committed(
    private_redis: PrivateRedis, tmp_path: Path, model: str
) -> None:
    with serving(redis_url=private_redis.url, data_dir=tmp_path / "data") as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, make_masters(), model=model)
        learner.push(2, make_masters(1), model=model)
    # As if the server died between writing version 2's file and committing it in Redis.
    r = redis.Redis.from_url(private_redis.url)
    r.zrem(f"weightsvc:{{{model}}}:versions", "2")
    r.hdel(f"weightsvc:{{{model}}}:manifests", "2")
    r.hdel(f"weightsvc:{{{model}}}:digests", "2")
    with serving(redis_url=private_redis.url, data_dir=tmp_path / "data") as srv:
        assert [v.version for v in InferenceClient(srv.grpc_target).versions(model)] == [1]
    assert not (tmp_path / "data" / "models" / model / f"{2:020d}.safetensors").exists()


async def test_replicas_register_renew_and_leave(registry: Registry) -> None:
    a, b = Replica("a", "a:1", "http://a:2"), Replica("b", "b:1", "http://b:2")
    assert await registry.register(b) is False
    assert await registry.register(a) is False
    assert await registry.register(a) is True  # a renewal (a registry that forgot `a` would say False)
    assert await registry.replicas() == [a, b]
    await registry.deregister("b")
    assert await registry.replicas() == [a]
    assert await registry.register(b) is False


async def test_a_part_is_pending_until_its_version_commits(registry: Registry) -> None:
    owners = ["r1", "r0"]
    assert not await registry.part_pending("m", 3, "r0", owners)
    assert await registry.commit_part("m", 3, "r0", owners, "d0", '{"p": 0}', retain=4) is None
    assert await registry.part_pending("m", 3, "r0", ["r0", "r1"])
    assert not await registry.part_pending("m", 3, "r1", owners)
    assert not await registry.part_pending("m", 3, "r0", ["r0", "r2"])  # (another set of owners)
    assert await registry.commit_part("m", 3, "r1", owners, "d1", '{"p": 1}', retain=4) is not None
    assert not await registry.part_pending("m", 3, "r0", owners)


async def test_a_version_of_parts_restored_from_its_record_is_the_same_version(registry: Registry) -> None:
    """A registry that lost its data takes a version back from the record a holder kept (what
    `manifest` returned): the same digest and manifest, and its owners' parts are its parts again."""
    owners = ["r0", "r1"]
    await registry.commit_part("m", 3, "r0", owners, "d0", '{"p": 0}', retain=4)
    await registry.commit_part("m", 3, "r1", owners, "d1", '{"p": 1}', retain=4)
    await registry.commit("m", 4, "d4", manifest(4), retain=4)
    record = await registry.manifest("m", 3)
    assert record is not None and record_digest(record) == combined_digest(owners, {"r0": "d0", "r1": "d1"})
    if isinstance(registry, RedisRegistry):  # its data lost: this test's own keys
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"{registry.prefix}:*"):
            client.delete(key)
    else:
        registry = MemoryRegistry()
    assert await registry.restore("m", 3, record_digest(record), record, retain=4)
    assert (await registry.versions("m"), await registry.manifest("m", 3)) == ([3], record)
    again = await registry.commit_part("m", 3, "r1", owners, "d1", '{"p": 1}', retain=4)  # an owner that retries
    assert again is not None and not again.created
    with pytest.raises(AlreadyExists):
        await registry.restore("m", 3, "sha1:other", record, retain=4)


@needs_redis
def test_replicas_sharing_redis_see_each_other(model: str) -> None:
    prefix = f"weightsvc-test-{uuid.uuid4().hex[:12]}"
    shared = {"redis_url": REDIS_URL, "redis_prefix": prefix}
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1:
        with serving(**shared, replica_id="r2") as r2:
            for srv in (r0, r1, r2):  # every replica gives the same topology, over gRPC and HTTP
                assert [r.id for r in InferenceClient(srv.grpc_target).topology()] == ["r0", "r1", "r2"]
            assert InferenceClient(r1.http_url).topology()[2].grpc == r2.grpc_target
        # A replica that stops leaves the topology at once.
        assert [r.id for r in InferenceClient(r0.grpc_target).topology()] == ["r0", "r1"]
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


def test_a_single_server_is_its_own_topology(server: BackgroundServer) -> None:
    (only,) = InferenceClient(server.grpc_target).topology()
    assert (only.grpc, only.http) == (server.grpc_target, server.http_url)


async def test_a_version_of_parts_commits_when_the_last_owner_has_its_part_in(registry: Registry) -> None:
    owners = ["r2", "r0", "r1"]
    assert await registry.commit_part("m", 7, "r0", owners, "d0", '{"p": 0}', retain=4) is None
    assert await registry.commit_part("m", 7, "r2", owners, "d2", '{"p": 2}', retain=4) is None
    assert await registry.versions("m") == []  # nothing visible while a part is missing
    done = await registry.commit_part("m", 7, "r1", owners, "d1", '{"p": 1}', retain=4)
    assert done is not None and done.created
    assert await registry.versions("m") == [7]
    parts = json.loads(await registry.manifest("m", 7) or "")
    assert {o: (p["digest"], json.loads(p["manifest"])) for o, p in parts.items()} == {
        "r0": ("d0", {"p": 0}), "r1": ("d1", {"p": 1}), "r2": ("d2", {"p": 2})
    }
    # An owner that retries its part of the committed version is told so; another part is a conflict.
    again = await registry.commit_part("m", 7, "r2", owners, "d2", '{"p": 2}', retain=4)
    assert again is not None and not again.created
    # The version's digest covers every part, the same in either registry.
    combined = combined_digest(["r0", "r1", "r2"], {"r0": "d0", "r1": "d1", "r2": "d2"})
    with pytest.raises(AlreadyExists, match=rf"already committed with different content \(master digest {combined},"):
        await registry.commit_part("m", 7, "r2", owners, "other", '{"p": 9}', retain=4)
    assert not await registry.withdraw_part("m", 7, "r0")  # too late: it committed


async def test_parts_withdrawn_leave_nothing_and_owner_sets_gather_apart(registry: Registry) -> None:
    assert await registry.commit_part("m", 3, "r0", ["r0", "r1"], "d0", "{}", retain=4) is None
    # A part declaring other owners (a push made again without a replica that went down) gathers
    # with the parts of those owners only: r0's part above does not complete it.
    assert await registry.commit_part("m", 3, "r1", ["r1", "r2"], "d1", "{}", retain=4) is None
    assert await registry.withdraw_part("m", 3, "r0", ["r0", "r1"])  # r1 never came: r0 takes its part back
    # A new attempt starts from nothing: r0's old part does not complete it.
    assert await registry.commit_part("m", 3, "r1", ["r0", "r1"], "d1", "{}", retain=4) is None
    assert await registry.versions("m") == []
    # The owners of a group of tensors must hold the same bytes of it, or nothing commits.
    assert await registry.withdraw_part("m", 3, "r1", ["r1", "r2"])
    assert await registry.commit_part("m", 3, "r2", ["r1", "r2"], "d2", "{}", retain=4, groups={"r1,r2": "x"}) is None
    with pytest.raises(DataLoss, match=r"the owners \['r1', 'r2'\] of a group of tensors exported different bytes"):
        await registry.commit_part("m", 3, "r1", ["r1", "r2"], "d1", "{}", retain=4, groups={"r1,r2": "y"})
    assert await registry.versions("m") == []
    with pytest.raises(FailedPrecondition, match="step 2 is not above the latest version 5"):
        await registry.commit("m", 5, "d5", manifest(5), retain=4)
        await registry.commit_part("m", 2, "r0", ["r0"], "d", "{}", retain=4)


def test_a_registry_that_lost_its_data_gets_the_versions_back_from_the_files(
    private_redis: PrivateRedis, tmp_path: Path, model: str
) -> None:
    """Redis comes back empty, a version commits, the server restarts: the versions committed before
    are still on disk, served, and back in the registry; none is deleted."""
    data = tmp_path / "data"
    with serving(redis_url=private_redis.url, data_dir=data) as srv, LearnerClient(srv.grpc_target) as learner:
        for step in (1, 2, 3):
            learner.push(step, make_masters(step), model=model)
        redis.Redis.from_url(private_redis.url).flushall()  # as if Redis restarted without its data
        learner.push(4, make_masters(4), model=model)
        digests = {v: InferenceClient(srv.grpc_target).manifest(model, v).master_digest for v in (1, 2, 3, 4)}
    with serving(redis_url=private_redis.url, data_dir=data) as srv:
        puller = InferenceClient(srv.grpc_target)
        assert [v.version for v in puller.versions(model)] == [1, 2, 3, 4]
        for v, digest in digests.items():
            assert puller.manifest(model, v).master_digest == digest
            puller.pull(model, v)  # (checksums verified)
        r = redis.Redis.from_url(private_redis.url)
        assert [int(v) for v in r.zrange(f"weightsvc:{{{model}}}:versions", 0, -1)] == [1, 2, 3, 4]
    assert len(list((data / "models" / model).glob("*.safetensors"))) == 4


async def test_restore_takes_back_a_lost_version_below_the_latest(registry: Registry) -> None:
    await registry.commit("m", 5, "d5", manifest(5), retain=3)
    assert await registry.restore("m", 3, "d3", manifest(3), retain=3)
    assert await registry.restore("m", 3, "d3", manifest(3), retain=3)  # held already: the same
    assert await registry.versions("m") == [3, 5]
    with pytest.raises(AlreadyExists, match="'m' version 3 is already committed with different content"):
        await registry.restore("m", 3, "other", manifest(3), retain=3)
    assert await registry.restore("m", 4, "d4", manifest(4), retain=3)
    assert not await registry.restore("m", 1, "d1", manifest(1), retain=3)  # older than retention keeps
    assert await registry.versions("m") == [3, 4, 5]


@needs_redis
def test_a_commit_whose_answer_is_lost_is_read_back_and_never_loses_its_file(
    monkeypatch: pytest.MonkeyPatch, redis_prefix: str, tmp_path: Path, model: str
) -> None:
    """Redis runs the commit script, then its answer times out. The server asks it back: the version
    is served and its file kept. When even that question fails, the push fails, and its retry (the
    registry says the version exists, with this content) serves the version."""
    real_commit, real_manifest = RedisRegistry.commit, RedisRegistry.manifest

    async def answer_lost(self: RedisRegistry, *args: Any, **kwargs: Any) -> Any:
        await real_commit(self, *args, **kwargs)
        raise Unavailable("registry unreachable while committing: Timeout reading from socket")

    async def unreachable(self: RedisRegistry, *args: Any, **kwargs: Any) -> Any:
        raise Unavailable("registry unreachable while reading: Timeout reading from socket")

    data = tmp_path / "data"
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "data_dir": data}
    with serving(**shared) as srv, LearnerClient(srv.grpc_target) as learner:
        puller = InferenceClient(srv.grpc_target)
        monkeypatch.setattr(RedisRegistry, "commit", answer_lost)
        assert learner.push(1, make_masters(1), model=model).created
        assert [v.version for v in puller.versions(model)] == [1]
        monkeypatch.setattr(RedisRegistry, "manifest", unreachable)
        with pytest.raises(Unavailable, match="registry unreachable while committing"):
            learner.push(2, make_masters(2), model=model)
        monkeypatch.setattr(RedisRegistry, "commit", real_commit)
        monkeypatch.setattr(RedisRegistry, "manifest", real_manifest)
        assert not learner.push(2, make_masters(2), model=model).created  # committed by the first try
        assert [v.version for v in puller.versions(model)] == [1, 2]
        puller.pull(model, 2)
    assert len(list((data / "models" / model).glob("*.safetensors"))) == 2
