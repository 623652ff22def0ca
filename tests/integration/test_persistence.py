"""--data-dir: committed versions survive a restart, bit for bit; damaged or partial files do not load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.conftest import make_masters, serving, start_server
from weightsvc import InferenceClient, LearnerClient
from weightsvc.errors import NotFound, Unavailable, WeightsvcError


def version_files(data_dir: Path, model: str) -> list[str]:
    return sorted(p.name for p in (data_dir / "models" / model).glob("*"))


def test_restart_restores_committed_versions(data_dir: Path) -> None:
    masters = make_masters()
    with serving(data_dir=data_dir, retain=2) as srv:
        learner = LearnerClient(srv.grpc_target)
        for step in (1, 2, 3):
            learner.push(step, masters, model="m")
        before = {v: InferenceClient(srv.grpc_target).pull("m", v) for v in (2, 3)}
        manifests = {v: InferenceClient(srv.grpc_target).manifest("m", v) for v in (2, 3)}
    # Retention removed version 1 from disk too.
    assert version_files(data_dir, "m") == [f"{v:020d}.safetensors" for v in (2, 3)]

    with serving(data_dir=data_dir, retain=2) as srv:
        puller = InferenceClient(srv.grpc_target)
        assert [v.version for v in puller.versions("m")] == [2, 3]
        for v in (2, 3):
            assert puller.manifest("m", v) == manifests[v]
            after = puller.pull("m", v)  # checksums verified on the way
            assert all(after[n].view(-1).equal(before[v][n].view(-1)) for n in masters)
        # The restored store goes on: steps must still increase.
        LearnerClient(srv.grpc_target).push(4, masters, model="m")
        assert [v.version for v in puller.versions("m")] == [3, 4]


def test_damaged_and_partial_files_are_not_restored(data_dir: Path) -> None:
    masters = make_masters()
    with serving(data_dir=data_dir) as srv:
        for step in (1, 2):
            LearnerClient(srv.grpc_target).push(step, masters, model="m")
    model_dir = data_dir / "models" / "m"
    damaged = model_dir / f"{2:020d}.safetensors"
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF  # one flipped bit in the last tensor
    damaged.write_bytes(bytes(raw))
    (model_dir / f".{3:020d}.safetensors.123.tmp").write_bytes(b"half a write")

    with serving(data_dir=data_dir) as srv:
        puller = InferenceClient(srv.grpc_target)
        assert [v.version for v in puller.versions("m")] == [1]
        assert not list(model_dir.glob(".*.tmp"))


def test_a_flipped_bit_in_a_header_tensor_name_is_caught_and_the_file_set_aside(data_dir: Path) -> None:
    """The header's own entry for a tensor (not the manifest it carries) is what a plain safetensors
    reader of the download goes by: damage there is found at restart, the file is moved aside under
    damaged/ and counted, and the other versions are served."""
    masters = make_masters()
    with serving(data_dir=data_dir) as srv:
        for step in (1, 2):
            LearnerClient(srv.grpc_target).push(step, masters, model="m")
    path = data_dir / "models" / "m" / f"{2:020d}.safetensors"
    raw = bytearray(path.read_bytes())
    entry = raw.rindex(b'"embed.weight":{"dtype"', 0, 8 + int.from_bytes(raw[:8], "little"))
    raw[entry + 1] ^= 0x01  # "embed.weight" -> "dmbed.weight", in the header entry alone
    path.write_bytes(bytes(raw))

    with serving(data_dir=data_dir) as srv:
        assert [v.version for v in InferenceClient(srv.grpc_target).versions("m")] == [1]
        assert srv.service.metrics.damaged_files._value.get() == 1
    assert not path.exists()
    assert (data_dir / "damaged" / "m" / path.name).read_bytes() == bytes(raw)


@pytest.mark.skipif(sys.platform != "linux", reason="needs Linux: kills servers with SIGKILL and reads /proc")
def test_learner_killed_mid_push_leaves_nothing(data_dir: Path, tmp_path: Path) -> None:
    """A learner process dies (SIGKILL) in the middle of its stream: nothing visible, memory freed."""
    with serving(data_dir=data_dir) as srv:
        script = tmp_path / "learner.py"
        script.write_text(
            textwrap.dedent(f"""
            import sys, threading
            import torch
            from weightsvc import LearnerClient
            masters = {{"w": torch.zeros(8 << 20)}}  # 32 MiB: many chunks
            def progress(n, sent=[0]):
                sent[0] += n
                if sent[0] >= 4 << 20:
                    print("mid-push", flush=True)
                    threading.Event().wait()  # hang here until killed
            LearnerClient({srv.grpc_target!r}).push(1, masters, model="killed", progress=progress)
        """)
        )
        learner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        assert learner.stdout is not None
        assert learner.stdout.readline().strip() == "mid-push"
        srv.call(srv.service.wait_pushes(1))
        os.kill(learner.pid, signal.SIGKILL)
        learner.wait(30)
        srv.call(srv.service.wait_pushes(0))
        assert srv.service.metrics.staged_bytes._value.get() == 0
        with pytest.raises(NotFound):
            InferenceClient(srv.grpc_target).versions("killed")
        # Its staged file is gone too (the directory it was staged in may stay, empty).
        assert not list((data_dir / "models").glob("killed/*")) and not list((data_dir / "models").glob("killed/.*"))


def test_a_push_cancelled_during_its_commit_is_committed_whole(data_dir: Path) -> None:
    """The learner gives up while the version is being written: memory and disk must agree."""
    srv = start_server(data_dir=data_dir)
    writing, proceed = threading.Event(), threading.Event()
    files = srv.service.files
    assert files is not None
    write = files.write

    def slow_write(version: object) -> object:
        writing.set()
        proceed.wait(30)
        return write(version)  # type: ignore[arg-type]

    files.write = slow_write  # type: ignore[method-assign]
    try:
        learner = LearnerClient(srv.grpc_target)
        errors: list[BaseException] = []

        def push() -> None:
            try:
                learner.push(1, make_masters(), model="m")
            except WeightsvcError as e:
                errors.append(e)

        pushing = threading.Thread(target=push)
        pushing.start()
        assert writing.wait(30)
        learner.close()  # the learner's channel goes away mid-commit
        pushing.join(30)
        assert errors and "CANCELLED" in str(errors[0])
        proceed.set()
        committed = srv.call(anext(srv.service.watch("m", None)))  # returns once version 1 is visible
        assert committed.version == 1
        assert version_files(data_dir, "m") == [f"{1:020d}.safetensors"]
    finally:
        proceed.set()
        srv.__exit__(None, None, None)
    with serving(data_dir=data_dir) as srv:
        assert [v.version for v in InferenceClient(srv.grpc_target).versions("m")] == [1]


def test_a_failed_write_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with serving(data_dir=not_a_dir) as srv:
        with pytest.raises(Unavailable, match="model 'm' version 1: cannot persist to"):
            LearnerClient(srv.grpc_target).push(1, make_masters(), model="m")
        with pytest.raises(NotFound):
            InferenceClient(srv.grpc_target).versions("m")
