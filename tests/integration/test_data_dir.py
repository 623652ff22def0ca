"""--data-dir: a version lives in its file. A push stages its served bytes there, the committed
version is a read-only mapping of it, HTTP sends it with sendfile: the server's anonymous memory
grows neither with the size of a version nor with --retain."""

from __future__ import annotations

import mmap
import os
import stat
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ServeProcess, make_masters, serving
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import ResourceExhausted
from weightsvc.memory import process_status
from weightsvc.rounding import ExportSpec, Residual, export_state_dict

MIB = 1 << 20


def anonymous(pid: int) -> int:
    """RssAnon of process `pid`, in bytes."""
    return process_status(pid)["RssAnon"]


class PeakAnonymous:
    """The highest RssAnon of a process while the block runs, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, anonymous(pid), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, anonymous(self.pid))

    def __enter__(self) -> PeakAnonymous:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def big_masters(mib: int) -> dict[str, torch.Tensor]:
    """`mib` MiB of fp32 masters in 16 MiB tensors."""
    return {f"layers.{i}.weight": torch.randn(1024, 4096) * 0.02 for i in range(mib // 16)}


def maps_a_file(array: Any) -> bool:
    """Whether a numpy array is a view of a mapping (of a residual file)."""
    base = array.base
    return isinstance(getattr(base, "obj", base), mmap.mmap)


def get(url: str, headers: dict[str, str] | None = None) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as resp:
        return bytes(resp.read())


class Sendfiles:
    """(thread, bytes) of each of the kernel's sendfile calls to a socket; counted once the call returns,
    which may be after its client has every byte."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._changed = threading.Condition()

    def add(self, thread: str, sent: int) -> None:
        with self._changed:
            self.calls.append((thread, sent))
            self._changed.notify_all()

    def total(self, at_least: int) -> int:
        """The bytes sent, once they reach `at_least` (or what they are after 60 s)."""
        with self._changed:
            self._changed.wait_for(lambda: sum(n for _, n in self.calls) >= at_least, timeout=60)
            return sum(n for _, n in self.calls)


@pytest.fixture
def counted_sendfile() -> Iterator[Sendfiles]:
    """The kernel's sendfile calls to a socket while the test runs."""
    counts = Sendfiles()
    original = os.sendfile

    def sendfile(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        sent = original(out_fd, in_fd, offset, count)
        if stat.S_ISSOCK(os.fstat(out_fd).st_mode):
            counts.add(threading.current_thread().name, sent)
        return sent

    os.sendfile = sendfile  # type: ignore[assignment]
    try:
        yield counts
    finally:
        os.sendfile = original


def test_a_version_is_its_file_served_by_sendfile(data_dir: Path, counted_sendfile: Sendfiles) -> None:
    masters = make_masters()
    masters["layers.1.weight"] = torch.randn(1024, 1024) * 0.02  # 2 MiB served: several sendfile pieces
    with serving(data_dir=data_dir, retain=2) as srv:
        learner = LearnerClient(srv.grpc_target)
        for step in (1, 2, 3):
            learner.push(step, masters, model="m")
        files = srv.service.files
        assert files is not None
        version = srv.service.index.get("m", None)
        assert version.file is not None and version.file.path == files.path("m", 3)
        assert version.data.readonly  # a mapping of the file, not a buffer of this process
        model_dir = files.path("m", 3).parent
        assert sorted(p.name for p in model_dir.iterdir()) == [files.path("m", v).name for v in (2, 3)]

        url = f"{srv.http_url}/v1/models/m/versions/3/safetensors"
        raw = files.path("m", 3).read_bytes()
        assert get(url) == raw  # the file, byte for byte
        data_bytes = version.manifest.data_bytes
        assert counted_sendfile.total(data_bytes) == data_bytes  # its data section went by sendfile
        # from the writers, off the loop
        assert {t.split("_")[0] for t, _ in counted_sendfile.calls} == {"weightsvc-pull"}
        assert get(url, {"Range": "bytes=100-"}) == raw[100:]
        assert get(url, {"Range": f"bytes={len(raw) - 5000}-{len(raw) - 2}"}) == raw[len(raw) - 5000 : -1]
        by_http = InferenceClient(srv.http_url).pull("m", 3)  # checksums verified
        by_grpc = InferenceClient(srv.grpc_target).pull("m", 3)
        assert all(by_http[n].view(-1).view(torch.int16).equal(by_grpc[n].view(-1).view(torch.int16))
                   for n in masters if by_grpc[n].dtype == torch.bfloat16)


def test_an_evicted_version_stays_readable_by_the_pull_that_holds_it(data_dir: Path) -> None:
    masters = make_masters()
    with serving(data_dir=data_dir, retain=1) as srv:
        learner = LearnerClient(srv.grpc_target)
        learner.push(1, masters, model="m")
        pull = srv.call(srv.service.pulls.open("m", 1, "grpc"))
        before = bytes(pull.version.data)
        learner.push(2, masters, model="m")  # evicts version 1 and removes its file
        assert not srv.service.files.path("m", 1).exists()  # type: ignore[union-attr]
        assert bytes(pull.version.data) == before  # still mapped while the pull holds it
        file = pull.version.file
        assert file is not None and not file.file.closed
        srv.call(_on_the_loop(pull.close))
        assert file.file.closed  # the last reader gone, the mapping goes


async def _on_the_loop(close: Callable[[], None]) -> None:
    close()  # a pull ends on the server's loop, as its transport ends it


def test_without_a_data_dir_versions_stay_in_memory() -> None:
    with serving() as srv:
        LearnerClient(srv.grpc_target).push(1, make_masters(), model="m")
        version = srv.service.index.get("m", None)
        assert version.file is None and not version.data.readonly
        raw = get(f"{srv.http_url}/v1/models/m/versions/1/safetensors")
        assert raw == bytes(version.header) + bytes(version.data)


def test_a_version_larger_than_the_memory_budget_is_pushed_restored_and_pulled(tmp_path: Path) -> None:
    """384 MiB served against --max-rss-bytes of 320 MiB: staged in its file, never in memory."""
    masters = big_masters(768)
    budget = ["--max-rss-bytes", str(320 * MIB)]
    data = tmp_path / "data"
    srv = ServeProcess("--data-dir", str(data), *budget)
    try:
        with PeakAnonymous(srv.proc.pid) as peak:
            assert LearnerClient(srv.target).push(1, masters, model="big").created
        assert peak.peak < 320 * MIB
        pulled = InferenceClient(srv.url).pull("big", 1)  # checksums verified
    finally:
        srv.stop()
    srv = ServeProcess("--data-dir", str(data), *budget)
    try:
        assert [v.version for v in InferenceClient(srv.target).versions("big")] == [1]
        again = InferenceClient(srv.target).pull("big", 1)
        assert all(again[n].view(torch.int16).equal(pulled[n].view(torch.int16)) for n in masters)
        del again, pulled
        assert anonymous(srv.proc.pid) < 320 * MIB
        assert LearnerClient(srv.target).push(2, masters, model="big").created
    finally:
        srv.stop()
    # The same push held in memory passes the budget: refused.
    srv = ServeProcess(*budget)
    try:
        with pytest.raises(ResourceExhausted, match="--max-rss-bytes"):
            LearnerClient(srv.target).push(1, masters, model="big")
    finally:
        srv.stop()


def test_anonymous_memory_does_not_grow_with_retain(tmp_path: Path) -> None:
    """7 versions of 128 MiB served: retaining 6 of them costs no more memory than retaining 1."""
    masters = big_masters(256)
    peaks = {}
    for retain in (1, 6):
        srv = ServeProcess("--data-dir", str(tmp_path / f"retain-{retain}"), "--retain", str(retain))
        try:
            with LearnerClient(srv.target) as learner, PeakAnonymous(srv.proc.pid) as peak:
                for step in range(1, 8):
                    learner.push(step, masters, model="big")
            peaks[retain] = peak.peak
            assert len(InferenceClient(srv.target).versions("big")) == retain
        finally:
            srv.stop()
    # In memory, retaining 6 would hold 5 more versions (640 MiB); here not one more.
    assert peaks[6] < peaks[1] + 128 * MIB, peaks
    assert peaks[6] < 512 * MIB, peaks


def test_the_ef_residual_lives_in_its_file(data_dir: Path) -> None:
    masters = make_masters()
    with serving(data_dir=data_dir, rounding="ef") as srv:
        learner = LearnerClient(srv.grpc_target)
        for step in (1, 2):
            learner.push(step, masters, model="m")
        residual = srv.service.committer.residuals.for_push("m", "bf16", srv.server.settings.scaling)
        assert residual.version == 2
        assert all(maps_a_file(r) for r in residual.tensors.values())
        served = InferenceClient(srv.grpc_target).pull("m", 2)
        files = sorted(p.name for p in (data_dir / "models" / "m").iterdir())
        assert files == [f"{1:020d}.safetensors", f"{2:020d}.safetensors", f"residual-{2:020d}.safetensors"]
    with serving(data_dir=data_dir, rounding="ef") as srv:  # restored from the file, mapped again
        residual = srv.service.committer.residuals.for_push("m", "bf16", srv.server.settings.scaling)
        assert residual.version == 2
        assert all(maps_a_file(r) for r in residual.tensors.values())
        LearnerClient(srv.grpc_target).push(3, masters, model="m")
    # The chain is the learner's own: the same bits as exporting 1, 2, 3 with one residual.
    own = Residual()
    for step in (1, 2, 3):
        want = export_state_dict(masters, ExportSpec("bf16", "ef"), version=step, residual=own)
        if step == 2:
            assert all(want[n].view(torch.int16).equal(served[n].view(torch.int16)) for n in masters)
