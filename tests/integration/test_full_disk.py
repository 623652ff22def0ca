"""--data-dir on a disk that fills: a push makes room by evicting the model's oldest versions that
nothing needs, and a file that still does not fit (a version's or an ef residual's) is
RESOURCE_EXHAUSTED with the bytes it needs and those free, leaving nothing behind. A sharded
replica never evicts its part of a version the registry retains: the push that does not fit is
refused.

The disk is a tmpfs of its own, resized between pushes (mounting one needs root on Linux)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import serving
from tests.helpers import REDIS_URL, assert_served, needs_redis
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import NotFound, ResourceExhausted
from weightsvc.protocol.topology import assign
from weightsvc.rounding import ExportSpec, Residual, export_state_dict

MIB = 1 << 20


class Disk:
    """A filesystem of its own (tmpfs), whose size the test sets."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _mount(self, *options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["mount", *options, str(self.path)], capture_output=True, text=True)

    def resize(self, size: int) -> None:
        done = self._mount("-o", f"remount,size={size}")
        assert done.returncode == 0, done.stderr

    def used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def mounted(path: Path) -> Iterator[Disk]:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("a disk that fills is a tmpfs of its own: mounting one needs root on Linux")
    d = Disk(path)
    d.path.mkdir()
    done = d._mount("-t", "tmpfs", "-o", f"size={64 * MIB},mode=0700", "weightsvc-test")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "--lazy", str(d.path)], check=False)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    with mounted(tmp_path / "disk") as d:
        yield d


def masters(mib: int) -> dict[str, torch.Tensor]:
    """`mib` MiB of fp32 masters (half of it served as bf16)."""
    gen = torch.Generator().manual_seed(mib)
    return {f"layers.{i}.weight": torch.randn(256, 1024, generator=gen) * 0.02 for i in range(mib)}


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def files(data: Path) -> list[str]:
    return sorted(p.name for p in (data / "models" / "m").iterdir())


def named(*versions: int, residual: int | None = None) -> list[str]:
    names = [f"{v:020d}.safetensors" for v in versions]
    return sorted(names + ([f"residual-{residual:020d}.safetensors"] if residual is not None else []))


def test_a_full_data_dir_evicts_the_oldest_versions_to_make_room(disk: Disk) -> None:
    """--retain 3 on a disk where two versions fit: every push commits, in place of the oldest."""
    data, weights = disk.path / "data", masters(2)
    with serving(data_dir=data, retain=3) as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, weights, model="m")
        one = allocated(data / "models" / "m" / named(1)[0])
        disk.resize(disk.used() + one + one // 2)
        learner.push(2, weights, model="m")
        for step in (3, 4):
            assert learner.push(step, weights, model="m").created
        puller = InferenceClient(srv.grpc_target)
        assert [v.version for v in puller.versions("m")] == [3, 4]
        with pytest.raises(NotFound, match="retained: 3, 4"):
            puller.pull("m", 2)
        assert files(data) == named(3, 4)
    with serving(data_dir=data, retain=3) as srv:  # what was evicted stays gone
        assert [v.version for v in InferenceClient(srv.grpc_target).versions("m")] == [3, 4]


def test_the_latest_version_and_one_being_pulled_stay_and_nothing_goes_for_a_file_that_cannot_fit(
    disk: Disk,
) -> None:
    data, weights = disk.path / "data", masters(2)
    with serving(data_dir=data, retain=3) as srv:
        learner, puller = LearnerClient(srv.grpc_target), InferenceClient(srv.grpc_target)
        learner.push(1, weights, model="m")
        one = allocated(data / "models" / "m" / named(1)[0])
        disk.resize(disk.used() + one + one // 2)
        learner.push(2, weights, model="m")
        pull = srv.call(srv.service.pulls.open("m", 1, "grpc"))  # holds version 1
        full = r"model 'm' version 3: .*No space left on device: it needs [\d,]+ bytes, [\d,]+ are free"
        with pytest.raises(ResourceExhausted, match=full + r".*no version of model 'm' may go"):
            learner.push(3, weights, model="m")
        srv.loop.call_soon_threadsafe(pull.close)
        # Evicting version 1 could not make room for this one: it stays.
        with pytest.raises(ResourceExhausted, match=full + r".*evicting version 1 would free only"):
            learner.push(3, masters(6), model="m")
        assert [v.version for v in puller.versions("m")] == [1, 2]
        assert files(data) == named(1, 2)  # nothing half-written left behind
        assert learner.push(3, weights, model="m").created
        assert [v.version for v in puller.versions("m")] == [2, 3]


def test_an_ef_residual_that_does_not_fit_is_resource_exhausted_like_a_version_file(disk: Disk) -> None:
    data, weights = disk.path / "data", masters(2)
    with serving(data_dir=data, retain=3, rounding="ef") as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, weights, model="m")
        # Room for the next version's file (1 MiB), not for its residual (2 MiB); version 1 is the latest.
        disk.resize(disk.used() + 3 * MIB // 2)
        free = disk.free()
        with pytest.raises(ResourceExhausted, match=r"model 'm' version 2: cannot persist the ef residual to .*"
                           r"No space left on device: it needs [\d,]+ bytes, [\d,]+ are free"):
            learner.push(2, weights, model="m")
        with pytest.raises(ResourceExhausted, match=r"model 'm' version 2: cannot persist to .*"
                           r"No space left on device: it needs [\d,]+ bytes, [\d,]+ are free"):
            learner.push(2, masters(4), model="m")  # its version file does not fit either
        assert srv.service.metrics.pushes_rejected.labels("too_large")._value.get() == 2
        assert files(data) == named(1, residual=1)
        assert disk.free() == free  # nothing half-written, nothing still holding its blocks


def test_an_ef_push_makes_room_for_its_residual_and_the_chain_goes_on(disk: Disk) -> None:
    data, weights = disk.path / "data", masters(2)
    spec = ExportSpec("bf16", "ef")
    with serving(data_dir=data, retain=3, rounding="ef") as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, weights, model="m")
        one, residual = allocated(data / "models" / "m" / named(1)[0]), allocated(data / "models" / "m" / named(
            residual=1)[0])
        # Two versions and two residuals (the latest's and the next push's): a third version does not fit.
        disk.resize(disk.used() + one + residual + one // 2)
        for step in (2, 3, 4):
            assert learner.push(step, weights, model="m").created
        assert [v.version for v in InferenceClient(srv.grpc_target).versions("m")] == [3, 4]
        assert files(data) == named(3, 4, residual=4)
        served = InferenceClient(srv.grpc_target).pull("m", 4)
    own = Residual()  # the learner's own chain: evictions never touched the residual it continues
    for step in (1, 2, 3, 4):
        want = export_state_dict(weights, spec, version=step, residual=own)
    assert all(want[n].view(torch.int16).equal(served[n].view(torch.int16)) for n in weights)


@needs_redis
@pytest.mark.parametrize("full", [1, 2])
def test_a_sharded_replica_on_a_full_disk_refuses_the_push_and_keeps_every_retained_part(
    tmp_path: Path, redis_prefix: str, full: int
) -> None:
    """Three replicas, each tensor on two of them; the disk of one (or two) fills. The next push is
    RESOURCE_EXHAUSTED naming the replica's data dir and the bytes, and every listed version keeps both
    holders of each group of tensors: their files, and every tensor pullable bit for bit from each replica."""
    weights = masters(6)
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "replication": 2, "retain": 4}
    with contextlib.ExitStack() as stack:
        disks = {r: stack.enter_context(mounted(tmp_path / f"disk-{r}")) for r in ("r2", "r1")[:full]}
        data = {r: (disks[r].path if r in disks else tmp_path / r) / "data" for r in ("r0", "r1", "r2")}
        replicas = [stack.enter_context(serving(**shared, replica_id=r, data_dir=d)) for r, d in data.items()]
        assert sorted(assign(weights, InferenceClient(replicas[0].grpc_target).topology(), 2)) == sorted(data)
        learner = LearnerClient(replicas[0].grpc_target)
        learner.push(1, weights, model="m")
        for r, d in disks.items():  # room for one more part and a half
            one = allocated(data[r] / "models" / "m" / named(1)[0])
            d.resize(d.used() + one + one // 2)
        learner.push(2, weights, model="m")
        full_dirs = "|".join(re.escape(str(data[r] / "models" / "m")) for r in disks)  # (whichever answers first)
        with pytest.raises(ResourceExhausted, match=rf"model 'm' version 3: cannot persist to ({full_dirs}): No space "
                           rf"left on device: it "
                           rf"needs [\d,]+ bytes, [\d,]+ are free.*this replica's parts of retained versions stay"):
            learner.push(3, weights, model="m")
        for srv in replicas:
            puller = InferenceClient(srv.grpc_target)
            assert [v.version for v in puller.versions("m")] == [1, 2]
            for step in (1, 2):
                whole = puller.manifest("m", step)
                assert all(len(p.holders) == 2 for p in whole.parts)
                holders = {h for p in whole.parts for h in p.holders}
                assert all((data[r] / "models" / "m" / named(step)[0]).exists() for r in holders), step
                assert_served(puller.pull("m", step), weights, step)
