"""`--device`: the service's export on the GPU (Triton) gives the CPU's bits. Here Triton's
interpreter runs the device code on the CPU (TRITON_INTERPRET=1, set in conftest): the same code
a GPU runs, the same bits; the GPU's own check is scripts/gpu_check.sh."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import WEIGHTSVC_CMD, ServeProcess, make_masters, serving
from tests.helpers import push_ranks
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import Shard
from weightsvc.errors import InvalidArgument, NotFound, Unavailable
from weightsvc.server.server import BackgroundServer
from weightsvc.service.device import HostBuffers

pytest.importorskip("weightsvc.rounding._triton", reason="needs triton (the dev extra, Linux x86_64)")

CASES = [("bf16", "sr", "tensor"), ("bf16", "ef", "tensor"), ("fp16", "rtn", "tensor"),
         ("fp8_e4m3", "sr", "block"), ("fp8_e4m3", "ef", "channel"), ("mxfp8", "sr", "block"),
         ("nvfp4", "ef", "block"), ("mxfp4", "sr-sticky", "block")]


def _steps(count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    state = make_masters(scale=0.05)
    out = []
    for _ in range(count):
        state = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in state.items()}
        out.append(state)
    return out


def _bits(srv: BackgroundServer, model: str, version: int) -> dict[str, bytes]:
    pulled = InferenceClient(srv.grpc_target).pull(model, version)
    return {n: t.reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in pulled.items()}


@pytest.mark.parametrize(("fmt", "rnd", "scaling"), CASES)
def test_device_cuda_serves_the_cpu_bits(fmt: str, rnd: str, scaling: str, model: str, tmp_path: Path) -> None:
    """An ef chain over three versions (the second pushed by two ranks): served bytes, checksums,
    lag metrics and residuals are the same on `--device cuda` as on `--device cpu`; a server
    restarted on the other device goes on with the chain bit for bit."""
    common = {"format": fmt, "rounding": rnd, "scaling": scaling, "fp8_pattern": ".*"}
    states = _steps(4)
    with serving(device="cpu", **common) as cpu, serving(device="cuda", data_dir=tmp_path / "gpu", **common) as gpu:
        assert gpu.server.device.startswith("cuda") and cpu.server.device == "cpu"
        for step, state in enumerate(states[:3], 1):
            for srv in (cpu, gpu):
                if step == 2:
                    names = list(state)
                    flat = state[names[2]].reshape(-1)
                    half = flat.numel() // 2
                    ranks: list[dict[str, torch.Tensor | Shard]] = [
                        {n: state[n] for n in names[:2]} | {names[2]: Shard(flat[:half], 0, state[names[2]].shape)},
                        {n: state[n] for n in names[3:]} | {names[2]: Shard(flat[half:], half, state[names[2]].shape)},
                    ]
                    for f in push_ranks(srv.grpc_target, step, ranks, model):
                        f.result()
                else:
                    with LearnerClient(srv.grpc_target) as learner:
                        learner.push(step, state, model)
            assert _bits(gpu, model, step) == _bits(cpu, model, step)
            on_cpu, on_gpu = (InferenceClient(s.grpc_target).manifest(model, step) for s in (cpu, gpu))
            assert [t.checksum for t in on_gpu.tensors] == [t.checksum for t in on_cpu.tensors]
            assert on_gpu.master_digest == on_cpu.master_digest and on_gpu.lag == on_cpu.lag
        if rnd == "ef":
            r_cpu = cpu.service.committer.residuals.current(model)
            r_gpu = gpu.service.committer.residuals.current(model)
            assert r_cpu.tensors.keys() == r_gpu.tensors.keys()
            for name, r in r_cpu.tensors.items():
                assert (r.view("uint32") == r_gpu.tensors[name].view("uint32")).all(), name
        with LearnerClient(cpu.grpc_target) as learner:
            learner.push(4, states[3], model)
        expected = _bits(cpu, model, 4)
    # The GPU server's data dir, restarted on the CPU: the chain goes on with the residual it kept.
    with serving(device="cpu", data_dir=tmp_path / "gpu", **common) as again:
        with LearnerClient(again.grpc_target) as learner:
            learner.push(4, states[3], model)
        assert _bits(again, model, 4) == expected


def test_a_device_error_fails_that_push_and_the_next_go_to_the_cpu(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU error mid-push (here a kernel that raises, as a CUDA fault would) refuses that push,
    leaves nothing visible, and the service exports on the CPU from then on."""
    from weightsvc.rounding import _triton

    def fault(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    state = make_masters()
    with serving(device="cuda") as gpu, serving(device="cpu") as cpu:
        for kernel in ("bf16_export", "bf16_runs_export"):  # big tensors' chunks, and small tensors
            monkeypatch.setattr(_triton, kernel, fault)
        with LearnerClient(gpu.grpc_target) as learner, pytest.raises(Unavailable, match=(
            r"the export on cuda[-:\w]* failed \(RuntimeError: CUDA error: an illegal memory access"
        )):
            learner.push(1, state, model)
        with pytest.raises(NotFound):
            InferenceClient(gpu.grpc_target).versions(model)
        with LearnerClient(gpu.grpc_target) as learner, LearnerClient(cpu.grpc_target) as reference:
            learner.push(1, state, model)
            reference.push(1, state, model)
        assert gpu.server.device == "cpu"
        with urllib.request.urlopen(f"{gpu.http_url}/readyz") as resp:
            assert json.loads(resp.read())["device"] == "cpu"
        assert _bits(gpu, model, 1) == _bits(cpu, model, 1)


@pytest.mark.parametrize(("fmt", "scaling"), [("bf16", "tensor"), ("fp8_e4m3", "block")])
def test_ef_residuals_stay_on_the_device_between_versions(fmt: str, scaling: str, model: str) -> None:
    """With ef on the GPU, a committed version's residual stays there and the next push exports from
    it, not from a copy of the host's; a push that does not commit leaves the resident one as it was;
    the bits stay the CPU's throughout, and the gauge counts what is kept."""
    common = {"format": fmt, "rounding": "ef", "scaling": scaling, "fp8_pattern": ".*"}
    states = _steps(3)
    bad = {n: t.clone() for n, t in states[1].items()}
    next(iter(bad.values())).reshape(-1)[0] = float("nan")
    with serving(device="cuda", **common) as gpu, serving(device="cpu", **common) as cpu:
        for step, state in enumerate(states, 1):
            before = {source: _found(gpu, source) for source in ("device", "host")}
            with LearnerClient(gpu.grpc_target) as learner, LearnerClient(cpu.grpc_target) as reference:
                if step == 2:  # refused (NaN): the resident residual stays version 1's
                    with pytest.raises(InvalidArgument, match="non-finite"):
                        learner.push(step, bad, model)
                learner.push(step, state, model)
                reference.push(step, state, model)
            assert _bits(gpu, model, step) == _bits(cpu, model, step)
            # Version 1 starts from zeros; after it every chunk's residual is found on the device.
            found = {source: _found(gpu, source) - before[source] for source in ("device", "host")}
            assert (found["device"] > 0, found["host"] > 0) == ((True, False) if step > 1 else (False, True))
            kept = gpu.service.exporter.resident[model]
            residual = gpu.service.committer.residuals.current(model)
            assert sum(host.nbytes for host, _ in kept.values()) == residual.nbytes
            for host, on_device in kept.values():
                assert (on_device.cpu().numpy().view(np.uint32) == host.view(np.uint32)).all()
            assert _gauge(gpu, "weightsvc_gpu_residual_bytes") == residual.nbytes
    with serving(device="cuda", gpu_residual_bytes=0, **common) as gpu:
        with LearnerClient(gpu.grpc_target) as learner:
            learner.push(1, states[0], model)
            learner.push(2, states[1], model)
        assert not gpu.service.exporter.resident and _gauge(gpu, "weightsvc_gpu_residual_bytes") == 0


def _found(srv: BackgroundServer, source: str) -> float:
    """How many ef residual chunks the GPU export found on the device, or copied in from the host."""
    return _gauge(srv, f'weightsvc_gpu_residual_chunks_total{{source="{source}"}}')


def _gauge(srv: BackgroundServer, name: str) -> float:
    with urllib.request.urlopen(f"{srv.http_url}/metrics") as resp:
        line = next(x for x in resp.read().decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_host_buffers_are_reused_and_bounded() -> None:
    """The buffers chunks pass through to and from the device: one per power-of-two size, reused by
    the next chunk, and no more than the bound kept."""
    buffers = HostBuffers(pin=False, max_bytes=3 << 20)
    a = buffers.take((1 << 20) - 5)
    assert a.numel() == (1 << 20) - 5
    buffers.give(a)
    b = buffers.take(1 << 20)
    assert b.data_ptr() == a.data_ptr() and buffers.kept == 0  # the same buffer, taken again
    c, d, e = (buffers.take(1 << 20) for _ in range(3))
    for buf in (b, c, d, e):
        buffers.give(buf)
    assert buffers.kept == 3 << 20  # the fourth was let go


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_device_cuda_without_a_gpu_refuses_to_start_and_auto_takes_the_cpu() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([*WEIGHTSVC_CMD, "serve", "--device", "cuda", "--grpc-port", "0", "--http-port", "0",
                          "--probe-port", "0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert "--device cuda: torch sees no CUDA device (use --device cpu or auto)" in out.stderr
    srv = ServeProcess("--device", "auto", env={"TRITON_INTERPRET": "0"})
    try:
        with urllib.request.urlopen(f"{srv.url}/readyz") as resp:
            assert json.loads(resp.read()) == {"status": "ready", "device": "cpu"}
    finally:
        srv.kill()


def test_the_device_benches_run_under_the_interpreter() -> None:
    """scripts/gpu_check.sh's kernel figures, run tiny on Triton's interpreter: the device time of a
    GPU session is scarce, so a bench that fails there must fail here first. The profile puts the
    launch in use back."""
    from weightsvc.cli.bench import gpu
    from weightsvc.rounding import _triton

    in_use = dict(_triton.LAUNCH)
    figures = gpu.cuda_kernel_bench(size_mib=0.25, repeat=1, device="cpu")
    assert {"K1_cuda", "K2_cuda", "K3_cuda_fp8_block_sr", "K3_cuda_nvfp4_sr"} <= figures.keys()
    # (ratios of the interpreter's speed to torch's cast: tiny, and rounded to 3 digits they may read 0)
    assert all(isinstance(v, float) and v >= 0 for k, v in figures.items() if k.startswith("K"))
    profile = gpu.cuda_kernel_profile(size_mib=1 / 64, repeat=1, device="cpu")
    assert profile["profile_best_sr_launch"] in {f"{b}x{w}" for b, w in gpu.LAUNCHES}
    assert len([k for k in profile if k.endswith("_sr_gbps") and "fp8" not in k]) == len(gpu.LAUNCHES)
    assert in_use == _triton.LAUNCH
    # The service side: servers started with --device cuda (the interpreter's) and cpu, a push of each.
    pushes = gpu.device_push_bench(size_mib=1, repeat=1, small=16)
    for device in ("cuda", "cpu"):
        assert pushes[f"K3_push_{device}_s"] > 0 and pushes[f"K3_small_push_{device}_us_per_tensor"] > 0
