"""The committer through its own interface, with no server: the commit rules, retention and a full
disk's eviction, a registry whose answer is lost, a restart, and a sharded replica following the
registry. Faults come in through the objects it is made of (a data dir that fills up, a registry
that does not answer)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.unit.test_store import make_version
from weightsvc.errors import AlreadyExists, DiskFull, FailedPrecondition, Unavailable
from weightsvc.metrics import Metrics
from weightsvc.rounding import Residual
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.replicas.registry import CommitResult, Registry
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.commit import Committer
from weightsvc.service.versions.disk import VersionFiles, load_version
from weightsvc.service.versions.index import Version, VersionIndex


@dataclasses.dataclass
class Rig:
    committer: Committer
    index: VersionIndex
    registry: Registry


def rig(files: VersionFiles | None = None, *, retain: int = 4, registry: Registry | None = None) -> Rig:
    """A committer wired as the service wires it."""
    metrics = Metrics()
    registry = registry if registry is not None else MemoryRegistry()
    index = VersionIndex(retain, metrics)
    committer = Committer(index=index, files=files, parts=Parts(registry, retain),
                          acks=Acks(index, registry, metrics), registry=registry, metrics=metrics)
    return Rig(committer, index, registry)


def shown(r: Rig, model: str = "m") -> list[int]:
    return [v.manifest.version for v in r.index.versions(model)]


def on_disk(files: VersionFiles, model: str = "m") -> list[str]:
    return sorted(p.name for p in files.path(model, 0).parent.iterdir())


def named(*versions: int) -> list[str]:
    return [f"{v:020d}.safetensors" for v in versions]


class FillingDisk(VersionFiles):
    """A data dir whose next `full` version writes find the disk full, with `free` bytes free."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.full = 0
        self.free = 0

    def write(self, version: Version) -> Version:
        if self.full:
            self.full -= 1
            raise DiskFull(f"model {version.manifest.model!r} version {version.manifest.version}: no space",
                           needed=1)
        return super().write(version)

    def free_bytes(self) -> int:
        return self.free


class AnswerLost(MemoryRegistry):
    """A registry that commits, then its answer is lost; `unreadable`: asking it back fails too."""

    def __init__(self) -> None:
        super().__init__()
        self.unreadable = False

    async def commit(self, *args: Any, **kwargs: Any) -> CommitResult:
        await super().commit(*args, **kwargs)
        raise Unavailable("registry unreachable while committing: Timeout reading from socket")

    async def manifest(self, model: str, version: int) -> str | None:
        if self.unreadable:
            raise Unavailable("registry unreachable while reading: Timeout reading from socket")
        return await super().manifest(model, version)


# ---- the commit rules --------------------------------------------------------------------------


async def test_a_step_below_the_latest_is_refused_naming_the_model_and_the_step(tmp_path: Path) -> None:
    files = VersionFiles(tmp_path)
    r = rig(files)
    await r.committer.commit(make_version("m", 2))
    refused = r"model 'm': step 1 is not above the latest version 2"
    with pytest.raises(FailedPrecondition, match=refused):
        r.committer.check_step("m", 1)
    with pytest.raises(FailedPrecondition, match=refused):
        await r.committer.commit(make_version("m", 1))
    assert shown(r) == [2] and on_disk(files) == named(2)  # the refused push wrote nothing


async def test_the_same_step_again_is_idempotent_with_its_digest_and_refused_with_another(tmp_path: Path) -> None:
    files = VersionFiles(tmp_path)
    r = rig(files)
    first, created = await r.committer.commit(make_version("m", 1))
    assert created
    r.committer.check_step("m", 1)  # a re-push of an existing step may go on
    again, created = await r.committer.commit(make_version("m", 1))
    assert not created and again is first
    with pytest.raises(AlreadyExists, match=r"model 'm' version 1 is already committed with different content"):
        await r.committer.commit(make_version("m", 1, fill=9))
    assert bytes(load_version(files.path("m", 1)).data[:4]) == b"\x01" * 4  # its file was not overwritten
    assert await r.registry.versions("m") == [1]


# ---- retention and a full disk -----------------------------------------------------------------


async def test_retention_keeps_the_newest_and_removes_the_files_of_the_others(tmp_path: Path) -> None:
    files = VersionFiles(tmp_path)
    r = rig(files, retain=2)
    for v in (1, 2, 3):
        await r.committer.commit(make_version("m", v))
    assert shown(r) == [2, 3]
    assert on_disk(files) == named(2, 3)


async def test_a_full_disk_evicts_the_oldest_version_that_no_pull_holds(tmp_path: Path) -> None:
    files = FillingDisk(tmp_path)
    r = rig(files)
    for v in (1, 2, 3):
        await r.committer.commit(make_version("m", v))
    r.index.hold(r.index.get("m", 1))  # a pull reads version 1: its blocks stay taken
    files.full = 1
    _, created = await r.committer.commit(make_version("m", 4))
    assert created
    assert shown(r) == [1, 3, 4]  # version 2 went; 1 is pulled, 3 was the latest
    assert on_disk(files) == named(1, 3, 4)


async def test_a_full_disk_that_eviction_cannot_cure_fails_the_commit_and_says_why(tmp_path: Path) -> None:
    files = FillingDisk(tmp_path)
    r = rig(files)
    for v in (1, 2):
        await r.committer.commit(make_version("m", v))
    files.full = 2  # full again after evicting
    with pytest.raises(DiskFull, match=r"no space, after evicting version 1 of model 'm'"):
        await r.committer.commit(make_version("m", 3))
    assert shown(r) == [2]
    r.index.hold(r.index.get("m", 2))
    files.full = 1
    with pytest.raises(DiskFull, match=r"no version of model 'm' may go to make room"):
        await r.committer.commit(make_version("m", 3))
    assert shown(r) == [2] and on_disk(files) == named(2)


# ---- a registry that does not answer -----------------------------------------------------------


async def test_a_commit_whose_answer_is_lost_is_asked_back_and_keeps_its_file(tmp_path: Path) -> None:
    files, registry = VersionFiles(tmp_path), AnswerLost()
    r = rig(files, registry=registry)
    _, created = await r.committer.commit(make_version("m", 1))
    assert created and shown(r) == [1] and on_disk(files) == named(1)
    registry.unreadable = True  # it cannot tell either: the commit fails, and leaves no file
    with pytest.raises(Unavailable, match="registry unreachable while committing"):
        await r.committer.commit(make_version("m", 2))
    assert shown(r) == [1] and on_disk(files) == named(1)


# ---- a restart ---------------------------------------------------------------------------------


async def test_a_restart_gives_back_what_the_files_hold_and_the_ef_residual_of_the_latest(tmp_path: Path) -> None:
    before = rig(VersionFiles(tmp_path))
    residual = Residual(2, {"w": np.full(4, 0.5, np.float32)}, "bf16", "")
    await before.committer.commit(make_version("m", 1))
    await before.committer.commit(make_version("m", 2), (1, residual, None))

    after = rig(VersionFiles(tmp_path), registry=before.registry)
    assert after.committer.restore() == 2
    await after.committer.sync_registry()
    assert shown(after) == [1, 2]
    assert bytes(after.index.get("m", 2).data[:4]) == b"\x02" * 4
    continued = after.committer.residuals.for_push("m", "bf16", "")
    assert continued.version == 2 and np.array_equal(continued.tensors["w"], residual.tensors["w"])


async def test_a_restart_restores_what_committed_and_drops_a_file_the_registry_never_committed(tmp_path: Path) -> None:
    before = rig(VersionFiles(tmp_path))
    for v in (1, 2):
        committed, created = await before.committer.commit(make_version("m", v))
        assert created and committed.manifest.version == v
    _, created = await before.committer.commit(make_version("m", 2))
    assert not created  # the same content again: an idempotent re-push
    VersionFiles(tmp_path).write(make_version("m", 3))  # written, then the process died before the registry

    files = VersionFiles(tmp_path)
    after = rig(files, registry=before.registry)
    assert after.committer.restore() == 3
    await after.committer.sync_registry()

    assert shown(after) == [1, 2]
    assert not files.path("m", 3).exists()
    assert bytes(after.index.get("m", 2).data[:4]) == b"\x02" * 4

    fresh = rig(VersionFiles(tmp_path))  # an embedded registry starts empty
    assert fresh.committer.restore() == 2
    await fresh.committer.sync_registry()
    assert await fresh.registry.versions("m") == [1, 2]


class LatePrune(VersionFiles):
    """A data dir whose prunes wait until the residual of version 2 is written."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir)
        self.next_written = threading.Event()

    def prune(self, model: str, versions: list[int], residual: int | None, upto: int | None = None) -> None:
        self.next_written.wait(30)  # the first commit's prune runs once the next residual is on disk
        super().prune(model, versions, residual, upto)

    def write_residual(self, model: str, residual: Residual, staged: Any = None) -> None:
        super().write_residual(model, residual, staged)
        if residual.version == 2:
            self.next_written.set()


async def test_a_commit_pruning_its_files_leaves_the_residual_of_the_next_commit_in_flight(tmp_path: Path) -> None:
    """The files of version 1's commit are pruned in a worker thread while the next ef commit writes
    its residual: that residual (of a version not yet committed when the prune began) must stay."""
    files = LatePrune(tmp_path)
    r = rig(files, retain=1)
    zeros = {"w": np.zeros(4, np.float32)}
    first = asyncio.ensure_future(
        r.committer.commit(make_version("m", 1), (None, Residual(1, zeros, "bf16", ""), None)))
    await r.index.shown("m", 1)
    await r.committer.commit(make_version("m", 2), (1, Residual(2, zeros, "bf16", ""), None))
    await first

    assert on_disk(files) == [f"{2:020d}.safetensors", f"residual-{2:020d}.safetensors"]


# ---- a sharded replica following the registry --------------------------------------------------


async def commit_without_this_replica(registry: Registry, version: int) -> None:
    """Version `version` of model m, made of the parts of replicas r1 and r2."""
    for owner in ("r1", "r2"):
        parts = Parts(registry, retain=4)
        parts.replica_id = owner
        m = parts.own(make_version("m", version, size=64, tensor=f"w-{owner}")).manifest
        await registry.commit_part("m", version, owner, ("r1", "r2"), m.master_digest, m.json(), 4)


async def test_a_sharded_replica_shows_what_committed_without_it_when_it_catches_up_and_as_it_follows() -> None:
    r = rig()
    await commit_without_this_replica(r.registry, 1)
    await r.committer.follower.catch_up("m")
    caught_up = r.index.get("m", 1)
    assert len(caught_up.data) == 0 and {p.owner for p in caught_up.manifest.parts} == {"r1", "r2"}

    following = asyncio.ensure_future(r.committer.follower.follow())
    try:
        await commit_without_this_replica(r.registry, 2)
        followed = await asyncio.wait_for(r.index.shown("m", 2), 10)
        assert followed is not None and len(followed.data) == 0 and len(followed.manifest.parts) == 2
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
