"""The version store's parts through their own interfaces: the index (retention, pulls, recycling),
the data dir's files, the acks and a sharded replica's parts (the committer: test_commit.py). Real
registries, real files; the service around them is tested in tests/integration."""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from weightsvc.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    TooManyRequests,
)
from weightsvc.memory import alloc
from weightsvc.metrics import Metrics
from weightsvc.protocol.digest import checksum
from weightsvc.protocol.manifest import Manifest, layout
from weightsvc.protocol.safetensors import framed, read_safetensors_header
from weightsvc.rounding import Residual
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.parts import PartOf, Parts
from weightsvc.service.replicas.registry import CommitResult
from weightsvc.service.versions import disk
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.index import Version, VersionIndex

SIZE = 1 << 20  # the pool recycles anonymous mappings; alloc maps one from 1 MiB


def make_version(model: str, v: int, *, fill: int | None = None, tensor: str = "w", size: int = SIZE) -> Version:
    """A committed-looking version of one fp32 tensor whose bytes are all `fill` (default: `v`)."""
    tensors, data_bytes = layout([(tensor, (size // 4,), "F32")])
    data = alloc(data_bytes)
    data[:] = bytes([v if fill is None else fill]) * data_bytes
    tensors = [dataclasses.replace(t, checksum=checksum(data[t.offset : t.offset + t.nbytes])) for t in tensors]
    m = Manifest(
        model=model,
        version=v,
        format="bf16",
        rounding="sr",
        seed=0,
        committed_unix=time.time(),
        data_bytes=data_bytes,
        master_digest=f"digest-{tensor}-{v}-{fill}",
        tensors=tuple(tensors),
    )
    return Version(m, m.safetensors_header(), data)


# ---- the index ---------------------------------------------------------------------------------


def test_retention_evicts_the_oldest_and_recycles_its_buffer_only_once_its_last_pull_ends() -> None:
    index = VersionIndex(retain=2, metrics=Metrics())
    first = make_version("m", 1)
    assert index.add(first) == []
    assert index.add(make_version("m", 2)) == []
    index.hold(first)
    assert index.add(make_version("m", 3)) == [1]
    assert first.evicted and [v.manifest.version for v in index.versions("m")] == [2, 3]
    retained = index.get("m", 2)
    index.hold(retained)
    index.release(retained)
    assert index.pool.free_bytes == 0  # a pull still reads the evicted one; the retained one stays
    assert bytes(first.data[:4]) == b"\x01" * 4
    index.release(first)
    assert index.pool.take(SIZE) is first.data  # the next push of that size writes into it
    with pytest.raises(NotFound, match=r"model 'm' has no version 1 \(retained: 2, 3\)"):
        index.get("m", 1)
    assert index.get("m", None).manifest.version == 3


def test_a_version_whose_views_were_shared_is_never_recycled() -> None:
    index = VersionIndex(retain=1, metrics=Metrics())
    shared = make_version("m", 1)
    shared.shared_views = True  # views of its bytes went to code that may still hold them
    index.add(shared)
    assert index.add(make_version("m", 2)) == [1]
    assert index.pool.free_bytes == 0



async def test_the_pool_keeps_buffers_of_retained_sizes_only_a_few_and_not_for_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weightsvc import memory

    index = VersionIndex(retain=1, metrics=Metrics())
    pool = index.pool
    pool.give(alloc(2 * SIZE))  # an aborted push of a size no version has: let go
    assert pool.free_bytes == 0
    index.add(make_version("m", 1))
    index.add(make_version("m", 2))  # version 1's buffer: the size of version 2, the next push's
    assert pool.free_bytes == SIZE
    for i in range(2, 8):  # more sizes than the pool keeps (each retained by a model of its own)
        index.add(make_version(f"m{i}", 1, size=i * SIZE))
        pool.give(alloc(i * SIZE))
    assert len(pool._free) == memory.BufferPool.MAX_BUFFERS and pool.take(SIZE) is None  # the oldest went

    now = time.monotonic()
    monkeypatch.setattr(memory.time, "monotonic", lambda: now + memory.BufferPool.IDLE_S)
    assert pool._timer is not None  # the idle check is due then
    pool._timer.cancel()
    pool._expire()  # (what the timer runs)
    assert pool.free_bytes == 0

    monkeypatch.setattr(memory.time, "monotonic", lambda: now)
    pool.give(alloc(7 * SIZE))
    index.add(make_version("m7", 2, size=SIZE))  # m7's versions are now of another size: its buffer goes
    assert pool.free_bytes == 0

async def test_a_watcher_waiting_for_a_version_gets_it_once_the_index_shows_it() -> None:
    index = VersionIndex(retain=2, metrics=Metrics())
    shown = asyncio.ensure_future(index.shown("m", 1))
    await asyncio.sleep(0)
    assert not shown.done()
    index.add(make_version("m", 1))
    await index.announce()
    got = await asyncio.wait_for(shown, 10)
    assert got is not None and got.manifest.version == 1


# ---- the data dir ------------------------------------------------------------------------------


def test_restore_skips_a_damaged_file_and_continues_the_residual_of_the_latest_version(tmp_path: Path) -> None:
    files = VersionFiles(tmp_path)
    for v in (1, 2, 3):
        files.write(make_version("m", v))
    for v in (2, 3):
        files.write_residual("m", Residual(v, {"w": np.full(4, v, np.float32)}, "bf16", ""))
    damaged = files.path("m", 2)
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(raw)
    (files.path("m", 4).parent / ".00000000000000000004.safetensors.1.tmp").write_bytes(b"half")

    [(model, versions, residual)] = list(files.restore())

    assert model == "m" and [v.manifest.version for v in versions] == [1, 3]
    assert bytes(versions[1].data[:4]) == b"\x03" * 4
    assert residual is not None and residual.version == 3 and residual.tensors["w"].tolist() == [3.0] * 4
    assert not list(files.path("m", 0).parent.glob(".*.tmp"))


def test_restore_sets_a_damaged_version_file_and_a_damaged_residual_aside_and_says_why(tmp_path: Path) -> None:
    files = VersionFiles(tmp_path)
    for v in (1, 2):
        files.write(make_version("m", v))
    files.write_residual("m", Residual(2, {"w": np.ones(4, np.float32)}, "bf16", ""))
    files.path("m", 1).write_bytes(files.path("m", 1).read_bytes()[:-1])  # cut short
    files.residual_path("m", 2).write_bytes(b"\xff" * 8)  # a header length beyond the file

    [(_, versions, residual)] = list(files.restore())

    assert [v.manifest.version for v in versions] == [2] and residual is None  # the next ef push starts from zero
    aside = tmp_path / "damaged" / "m"
    assert [(d.model, d.file) for d in files.damaged] == [
        ("m", str(aside / files.path("m", 1).name)),
        ("m", str(aside / files.residual_path("m", 2).name)),
    ]
    assert "data section is" in files.damaged[0].reason and files.damaged[1].reason
    assert (aside / files.residual_path("m", 2).name).read_bytes() == b"\xff" * 8


def test_the_residual_of_a_version_that_never_committed_is_not_continued(tmp_path: Path) -> None:
    files = VersionFiles(tmp_path)
    files.write(make_version("m", 1))
    files.write_residual("m", Residual(2, {"w": np.ones(4, np.float32)}, "bf16", ""))  # its version file never came
    [(_, versions, residual)] = list(files.restore())
    assert [v.manifest.version for v in versions] == [1] and residual is None


def test_prune_removes_the_versions_given_and_the_residuals_but_the_current_and_those_in_flight(tmp_path: Path) -> None:
    files = VersionFiles(tmp_path)
    for v in (1, 2):
        files.write(make_version("m", v))
        files.write_residual("m", Residual(v, {"w": np.zeros(4, np.float32)}, "bf16", ""))
    files.prune("m", [1], residual=2)
    assert sorted(p.name for p in files.path("m", 0).parent.iterdir()) == [
        f"{2:020d}.safetensors",
        f"residual-{2:020d}.safetensors",
    ]
    files.write_residual("m", Residual(3, {"w": np.zeros(4, np.float32)}, "bf16", ""))  # a commit in flight
    files.prune("m", [], residual=None, upto=2)
    assert sorted(p.name for p in files.path("m", 0).parent.iterdir()) == [
        f"{2:020d}.safetensors",
        f"residual-{3:020d}.safetensors",
    ]
    files.prune("m", [], residual=None)  # at start-up nothing is in flight
    assert [p.name for p in files.path("m", 0).parent.iterdir()] == [f"{2:020d}.safetensors"]


# ---- acks --------------------------------------------------------------------------------------


async def test_an_ack_counts_the_versions_behind_even_past_retention_and_reaches_the_registry() -> None:
    index, registry = VersionIndex(retain=1, metrics=Metrics()), MemoryRegistry()
    acks = Acks(index, registry, Metrics())
    for v in range(1, 6):
        index.add(make_version("m", v, size=8))
        acks.committed("m", v, time.time())

    assert await acks.ack("m", 2, "sampler-0", "token:a") == 5

    assert acks.versions_behind("m", 2) == 3  # versions 3, 4 and 5, though only 5 is retained
    assert {m: [c.lag_versions for c in cs] for m, cs in acks.tracked().items()} == {"m": [3]}
    assert [(c.client_id, c.version) for c in acks.clients("m")] == [("sampler-0", 2)]
    assert (await registry.acks("m"))["sampler-0"][0] == 2
    with pytest.raises(InvalidArgument, match=r"model 'm': cannot ack version 6, the latest committed is 5"):
        await acks.ack("m", 6, "sampler-0", "token:a")
    with pytest.raises(NotFound, match=r"unknown model 'other'"):
        await acks.ack("other", 1, "sampler-0", "token:a")
    with pytest.raises(InvalidArgument, match="client_id of 1-256 characters"):
        await acks.ack("m", 5, "", "token:a")



async def test_a_flood_of_new_client_ids_never_pushes_out_a_stale_client(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsvc.service.versions import acks as acks_module

    monkeypatch.setattr(acks_module, "ACKS_KEPT", 3)
    index, registry = VersionIndex(retain=2, metrics=Metrics()), MemoryRegistry()
    acks = Acks(index, registry, Metrics())
    for v in (1, 2):
        index.add(make_version("m", v, size=8))
        acks.committed("m", v, time.time())
    await acks.ack("m", 1, "stuck-0", "token:a")  # one version behind
    for i in range(100):  # fresh ids at the latest version take each other's place, not the stuck one's
        await acks.ack("m", 2, f"flood-{i}", "token:b")
    assert sorted(c.client_id for c in acks.clients("m")) == ["flood-98", "flood-99", "stuck-0"]
    assert max(c.lag_versions for c in acks.tracked()["m"]) == 1  # its alert still fires

    await acks.ack("m", 1, "flood-98", "token:b")
    await acks.ack("m", 1, "flood-99", "token:b")  # every place held by a stale client: a new one waits
    with pytest.raises(TooManyRequests, match=r"model 'm': 3 clients are tracked, every one behind version 2"):
        await acks.ack("m", 2, "new", "token:b")
    await acks.ack("m", 2, "stuck-0", "token:a")  # one catches up: its place may go to a new client
    await acks.ack("m", 2, "new", "token:b")
    assert sorted(c.client_id for c in acks.clients("m")) == ["flood-98", "flood-99", "new"]
    assert len(await registry.acks("m")) == 102  # (the registry's own bound, ACKS_KEPT of its module, is 10,000)


async def test_a_client_id_belongs_to_the_caller_that_acked_under_it_first() -> None:
    index = VersionIndex(retain=2, metrics=Metrics())
    acks = Acks(index, MemoryRegistry(), Metrics())
    index.add(make_version("m", 1, size=8))
    acks.committed("m", 1, time.time())
    await acks.ack("m", 1, "pod-7", "token:a")
    with pytest.raises(PermissionDenied, match=r"model 'm': client id 'pod-7' acks for another caller"):
        await acks.ack("m", 1, "pod-7", "token:b")
    assert await acks.ack("m", 1, "pod-7", "token:a") == 1


async def test_a_client_silent_past_forget_s_leaves_the_table_and_its_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsvc.service.versions import acks as acks_module

    index = VersionIndex(retain=2, metrics=Metrics())
    acks = Acks(index, MemoryRegistry(), Metrics())
    acks.forget_s = 60.0
    index.add(make_version("m", 1, size=8))
    start = time.time()
    acks.committed("m", 1, start)
    await acks.ack("m", 1, "pod-7", "token:a")
    monkeypatch.setattr(acks_module.time, "time", lambda: start + 61)
    await acks.ack("m", 1, "pod-7", "token:b")  # forgotten by both: the id is free again
    assert [(c.client_id, c.last_seen_unix) for c in acks.clients("m")] == [("pod-7", start + 61)]

# ---- a sharded replica's parts -----------------------------------------------------------------


async def test_the_owners_parts_commit_as_one_version_each_served_under_the_whole_manifest() -> None:
    registry = MemoryRegistry()
    owners = ("r0", "r1")
    parts = {o: Parts(registry, retain=2) for o in owners}
    for o in owners:
        parts[o].replica_id = o
    mine = {o: parts[o].own(make_version("m", 1, fill=i + 1, tensor=f"w{i}", size=64)) for i, o in enumerate(owners)}

    decided = await asyncio.gather(*(parts[o].commit(mine[o], PartOf(owners, timeout=30)) for o in owners))

    assert all(d.created for d, _, _ in decided)
    assert {record for _, _, record in decided} == {await registry.manifest("m", 1)}  # each keeps the record
    served = {o: v for o, (_, v, _) in zip(owners, decided, strict=True)}
    assert served["r0"].manifest == served["r1"].manifest
    assert [t.name for t in served["r0"].manifest.tensors] == ["w0", "w1"]
    assert [[(s.start, s.nbytes) for s in served[o].spans] for o in ("r0", "r1")] == [[(0, 64)], [(64, 64)]]
    assert served["r1"].part == mine["r1"].manifest and bytes(served["r1"].data[:1]) == b"\x02"
    assert await registry.versions("m") == [1]


async def test_a_part_whose_other_owner_never_comes_is_withdrawn_after_the_timeout() -> None:
    registry = MemoryRegistry()
    parts = Parts(registry, retain=2)
    parts.replica_id = "r0"
    part = parts.own(make_version("m", 1, size=64))
    with pytest.raises(DeadlineExceeded, match=r"model 'm' version 1: not every owner of \['r0', 'r1'\] committed"):
        await parts.commit(part, PartOf(("r0", "r1"), timeout=0.01))
    parts.check_not_waiting("m", 2)  # no longer waits: the next step may come
    # The withdrawn part is gone: the other owner's part alone does not complete the version.
    assert await registry.commit_part("m", 1, "r1", ("r0", "r1"), "d", "{}", 2) is None
    assert await registry.versions("m") == []


class TellsParts(MemoryRegistry):
    """A registry that sets `recorded` once it has recorded a part."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded = asyncio.Event()

    async def commit_part(self, *args: Any, **kwargs: Any) -> CommitResult | None:
        decided = await super().commit_part(*args, **kwargs)
        self.recorded.set()
        return decided


async def test_a_waiting_part_holds_back_the_next_step_until_its_learner_abandons_it() -> None:
    registry = TellsParts()
    parts = Parts(registry, retain=2)
    parts.replica_id = "r0"
    part_of = PartOf(("r0", "r1"), timeout=30)
    committing = asyncio.ensure_future(parts.commit(parts.own(make_version("m", 1, size=64)), part_of))
    await asyncio.wait_for(registry.recorded.wait(), 10)  # the part now waits for the other owner's
    with pytest.raises(FailedPrecondition, match="part of version 1 is waiting for the other owners' parts"):
        parts.check_not_waiting("m", 2)
    part_of.abandoned.set()
    with pytest.raises(Aborted, match=r"model 'm' version 1: the learner abandoned the push"):
        await committing
    parts.check_not_waiting("m", 2)


async def test_a_client_that_stops_acking_stays_in_the_staleness_metrics_until_it_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stuck client acks no more: after 5 minutes it is silent, not connected, yet its lag keeps
    counting (so StaleClients can fire) until --client-forget-s."""
    from prometheus_client.parser import text_string_to_metric_families

    from weightsvc.service.versions import acks as acks_module

    metrics = Metrics()
    index = VersionIndex(retain=2, metrics=metrics)
    acks = Acks(index, MemoryRegistry(), metrics)
    acks.forget_s = 3600.0
    start = time.time()
    index.add(make_version("m", 1, size=8))
    acks.committed("m", 1, start)
    await acks.ack("m", 1, "stuck-0", "token:a")

    def scraped(now: float) -> dict[str, float]:
        monkeypatch.setattr(acks_module.time, "time", lambda: now)
        text = metrics.render().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in ("weightsvc_clients", "weightsvc_clients_silent", "weightsvc_client_lag_versions")}

    for v in (2, 3, 4):
        index.add(make_version("m", v, size=8))
        acks.committed("m", v, start)
    assert scraped(start) == {"weightsvc_clients": 1, "weightsvc_clients_silent": 0,
                              "weightsvc_client_lag_versions": 3}
    assert scraped(start + 600) == {"weightsvc_clients": 0, "weightsvc_clients_silent": 1,
                                    "weightsvc_client_lag_versions": 3}
    assert scraped(start + 3700) == {"weightsvc_clients": 0, "weightsvc_clients_silent": 0,
                                     "weightsvc_client_lag_versions": 0}


def test_a_staged_versions_header_is_written_in_slices_and_padded_to_its_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "COPY_SLICE", 7)  # many slices, the last one short
    header = framed(b'{"__metadata__":{"k":"' + b"x" * 50 + b'"}}')
    path = tmp_path / "staged"
    path.write_bytes(b"\xff" * 200)
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 200) as mapping:
        disk._write_padded(mapping, header, 128)
        assert mapping[:128] == framed(header[8:], size=128)
        assert read_safetensors_header(mapping[:128]) == (128, {"__metadata__": {"k": "x" * 50}})
        assert mapping[128:] == b"\xff" * 72  # the data section is not touched
        with pytest.raises(ValueError, match="does not fit"):
            disk._write_padded(mapping, header, 16)


def test_alloc_lets_other_threads_map_memory_while_it_populates_a_big_buffer() -> None:
    """The pages of a big buffer are populated a piece at a time: a thread that maps memory meanwhile
    (the event loop starting a thread, Python's allocator taking an arena) waits for one piece, not
    for the whole buffer."""
    took: list[float] = []

    def populate() -> None:
        start = time.perf_counter()
        buf = alloc(512 << 20)
        took.append(time.perf_counter() - start)
        buf.release()

    worker = threading.Thread(target=populate)
    worst = 0.0
    worker.start()
    while worker.is_alive():
        start = time.perf_counter()
        mmap.mmap(-1, 1 << 20).close()
        worst = max(worst, time.perf_counter() - start)
    worker.join()
    assert worst < max(took[0] / 4, 0.02), (worst, took)
