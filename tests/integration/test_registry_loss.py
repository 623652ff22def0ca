"""Sharded replicas and a registry that loses its data: Redis flushed, restarted empty (as a failover
to an empty replica is), idle and while a learner pushes, and the replicas restarted after it, one at a
time. Three replica processes, each tensor on two of them, on a redis-server of the test's own.

Each scenario ends with every version the learner was told is committed listed by every replica,
pullable from each bit for bit, with both holders of each group of tensors and their files in place;
the learner sees only UNAVAILABLE (retry) while the registry is away or empty."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import ServeProcess, serving
from tests.helpers import PrivateRedis, assert_served
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import NotFound, Unavailable, WeightsvcError
from weightsvc.protocol.topology import assign
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

REPLICAS = ("r0", "r1", "r2")
PREFIX = "weightsvc"
MODEL = "m"


class EmptiedRedis(PrivateRedis):
    """The cluster's registry, without persistence: a restart comes back empty."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, persist=False)

    def restart_empty(self) -> None:
        self.kill()
        self.start()

    def versions(self) -> list[int]:
        return sorted(int(v) for v in self.client().zrange(f"{PREFIX}:{{{MODEL}}}:versions", 0, -1))


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[EmptiedRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH: the test starts a Redis of its own and empties it")
    r = EmptiedRedis(tmp_path)
    r.start()
    yield r
    r.kill()


class Cluster:
    """Three replica processes on the private Redis, each with its data dir; faults counted."""

    def __init__(self, registry: EmptiedRedis, data: Path) -> None:
        self.registry, self.data = registry, data
        self.procs = {r: self._start(r) for r in REPLICAS}
        self.faults = 0

    def _start(self, replica: str) -> ServeProcess:
        return ServeProcess("--redis-url", self.registry.url, "--redis-prefix", PREFIX, "--replica-id", replica,
                            "--data-dir", str(self.data / replica), "--replication", "2", "--retain", "16",
                            "--rounding", "sr", "--push-rank-timeout-s", "30")

    def restart(self, replica: str) -> None:
        self.procs[replica].kill()
        self.procs[replica] = self._start(replica)

    def flush(self) -> None:
        self.registry.client().flushall()
        self.faults += 1

    def restart_registry_empty(self) -> None:
        self.registry.restart_empty()
        self.faults += 1

    def rolling_restart(self) -> None:
        for replica in REPLICAS:
            self.restart(replica)
            self.faults += 1

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.proc.poll() is None:
                proc.kill()

    def lost(self, acknowledged: dict[int, dict[str, torch.Tensor]]) -> list[int]:
        """The acknowledged versions that some replica does not list, serve bit for bit, or hold with
        both holders of each part and their files (each check asserted after the count is taken)."""
        lost = set()
        for replica, proc in self.procs.items():
            with InferenceClient(proc.target) as client:
                try:
                    listed = {v.version for v in client.versions(MODEL)}
                except NotFound:
                    listed = set()
                lost |= set(acknowledged) - listed
                for step in sorted(set(acknowledged) & listed):
                    whole = client.manifest(MODEL, step)
                    holders = [p.holders for p in whole.parts]
                    if not holders or any(len(h) != 2 for h in holders):
                        lost.add(step)
                    if replica in {h for group in holders for h in group} and not self.file(replica, step).exists():
                        lost.add(step)
                    try:
                        assert_served(client.pull(MODEL, step), acknowledged[step], step)
                    except (AssertionError, WeightsvcError):
                        lost.add(step)
        return sorted(lost)

    def file(self, replica: str, step: int) -> Path:
        return self.data / replica / "models" / MODEL / f"{step:020d}.safetensors"

    def given_back(self, steps: list[int], timeout: float = 30) -> list[int]:
        """The registry's versions once it holds `steps` again (given back by the running replicas),
        or at the deadline: Redis is polled, there is nothing in it to wait on."""
        deadline = time.monotonic() + timeout
        while not set(steps) <= set(self.registry.versions()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.registry.versions()


def masters(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {f"layers.{i}.weight": torch.randn(32, 64, generator=gen) * 0.02 for i in range(8)}


@pytest.fixture
def cluster(private_redis: EmptiedRedis, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(private_redis, tmp_path / "data")
    owned = assign(masters(0), InferenceClient(c.procs["r0"].target).topology(), 2)
    assert sorted(owned) == list(REPLICAS)  # every replica holds a part of every version
    yield c
    c.stop()


def push(learner: LearnerClient, step: int, acknowledged: dict[int, dict[str, torch.Tensor]]) -> None:
    state = masters(step)
    assert learner.push(step, state, MODEL).version == step
    acknowledged[step] = state


def test_registry_flushed_while_idle_gets_its_versions_back_from_the_running_replicas(cluster: Cluster) -> None:
    acknowledged: dict[int, dict[str, torch.Tensor]] = {}
    with LearnerClient(cluster.procs["r0"].target) as learner:
        for step in (1, 2, 3):
            push(learner, step, acknowledged)
        cluster.flush()
        # At once, before the replicas registered again: the push still goes to both owners of each tensor
        # (the learner's way in answers the topology as it was), never to fewer.
        push(learner, 4, acknowledged)
        holders = [p.holders for p in InferenceClient(cluster.procs["r1"].target).manifest(MODEL, 4).parts]
        assert holders and all(len(h) == 2 for h in holders), holders
        # The replicas notice (the model set and their registrations vanished) and give their versions back.
        assert cluster.given_back([1, 2, 3, 4]) == [1, 2, 3, 4]
        assert cluster.lost(acknowledged) == []
        push(learner, 5, acknowledged)
    # And a restart of each replica keeps them all.
    cluster.rolling_restart()
    assert cluster.lost(acknowledged) == []
    print(f"registry loss, idle: {cluster.faults} faults, {len(cluster.lost(acknowledged))} versions lost")


def test_registry_restarted_empty_then_a_rolling_restart_keeps_every_version(cluster: Cluster) -> None:
    """The replicas restart one at a time right after the registry came back empty, before they could
    notice: each gives back what it holds at start-up from the record kept beside its parts."""
    acknowledged: dict[int, dict[str, torch.Tensor]] = {}
    with LearnerClient(cluster.procs["r1"].target) as learner:
        for step in (1, 2, 3):
            push(learner, step, acknowledged)
    cluster.restart_registry_empty()
    cluster.rolling_restart()
    assert cluster.registry.versions() == [1, 2, 3]
    assert cluster.lost(acknowledged) == []
    with LearnerClient(cluster.procs["r2"].target) as learner:
        push(learner, 4, acknowledged)
    # Once more, with every replica down while the registry is empty: they come back one by one.
    for proc in cluster.procs.values():
        proc.kill()
    cluster.restart_registry_empty()
    for replica in REPLICAS:
        cluster.procs[replica] = cluster._start(replica)
        cluster.faults += 1
    assert cluster.lost(acknowledged) == []
    print(f"registry restarted empty: {cluster.faults} faults, {len(cluster.lost(acknowledged))} versions lost")


def test_registry_lost_while_the_learner_pushes(cluster: Cluster) -> None:
    """A learner pushes step after step, retrying a step the service answers UNAVAILABLE; the registry is
    flushed, then restarted empty, under it. No other error reaches the learner, and every version it
    was told is committed has both holders of each group of tensors, everywhere."""
    acknowledged: dict[int, dict[str, torch.Tensor]] = {}
    others: list[WeightsvcError] = []
    retried = 0
    stop = threading.Event()
    pushed = threading.Condition()

    def learn() -> None:
        nonlocal retried
        step = 0
        with LearnerClient(cluster.procs["r0"].target, timeout=60) as learner:
            while not stop.is_set():
                step += 1
                while not stop.is_set():
                    try:
                        push(learner, step, acknowledged)
                        break
                    except Unavailable:
                        retried += 1
                        stop.wait(0.2)  # the learner's back-off: the registry is away
                    except WeightsvcError as e:
                        others.append(e)
                        return
                with pushed:
                    pushed.notify_all()

    def after(count: int) -> None:
        with pushed:
            assert pushed.wait_for(lambda: len(acknowledged) >= count or bool(others), timeout=120), len(acknowledged)

    learner = threading.Thread(target=learn)
    learner.start()
    try:
        after(2)
        cluster.flush()
        after(len(acknowledged) + 3)
        cluster.restart_registry_empty()
        after(len(acknowledged) + 3)
        cluster.flush()
        after(len(acknowledged) + 2)
    finally:
        stop.set()
        learner.join(120)
    assert others == []
    steps = sorted(acknowledged)
    assert cluster.given_back(steps) == steps
    assert cluster.lost(acknowledged) == []
    cluster.rolling_restart()
    lost = cluster.lost(acknowledged)
    assert lost == []
    print(f"registry loss mid-push: {cluster.faults} faults, {len(steps)} versions acknowledged, {retried} "
          f"pushes answered UNAVAILABLE and retried, {len(lost)} versions lost")


def _part(name: str, owners: list[str]) -> Iterator[pb.PushRequest]:
    """A replica's part of step 4 as the learner client sends it: one tensor, the owners declared."""
    spec = pb.TensorSpec(name=name, shape=[2], dtype="F32")
    yield pb.PushRequest(header=pb.PushHeader(model=MODEL, step=4, owners=owners, tensors=[spec]))
    yield pb.PushRequest(chunk=pb.Chunk(tensor=name, offset=0, data=torch.ones(2).numpy().tobytes()))
    yield pb.PushRequest(commit=pb.PushCommit())


def test_a_part_waiting_for_the_other_owners_is_recorded_again_after_the_registry_lost_it(
    private_redis: EmptiedRedis,
) -> None:
    """r0's part waits in the registry for r1's; the registry loses it (flushed); r1's part comes: the
    version commits all the same, well before the owners' deadline."""
    shared = {"redis_url": private_redis.url, "redis_prefix": PREFIX, "replication": 1, "push_rank_timeout_s": 60}
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1, \
            grpc.insecure_channel(r0.grpc_target) as ch0, grpc.insecure_channel(r1.grpc_target) as ch1:
        waiting = pb_grpc.WeightServiceStub(ch0).Push.future(_part("w0", ["r0", "r1"]), timeout=60)
        pending = f"{PREFIX}:{{{MODEL}}}:pending:*"
        deadline = time.monotonic() + 20
        while not list(private_redis.client().scan_iter(pending)) and time.monotonic() < deadline:
            time.sleep(0.02)  # Redis: nothing to wait on
        private_redis.client().flushall()
        started = time.monotonic()
        last = pb_grpc.WeightServiceStub(ch1).Push(_part("w1", ["r0", "r1"]), timeout=60)
        assert (last.version.version, waiting.result().version.version) == (4, 4)
        assert time.monotonic() - started < 30
        assert private_redis.versions() == [4]
        for srv in (r0, r1):
            assert [p.owner for p in srv.service.index.get(MODEL, 4).manifest.parts] == ["r0", "r1"]
