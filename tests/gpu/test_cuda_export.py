"""On a CUDA machine: the Triton kernels compiled for the GPU give the CPU kernels' bits, bit for
bit, for every format, rounding and fp8 scaling, residuals included. (Elsewhere these tests skip;
the same kernels run on the CPU through Triton's interpreter in tests/unit/test_triton.py.)"""

from __future__ import annotations

import pytest
import torch

from weightsvc import rounding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no CUDA device")

CASES = [(fmt, rnd, scaling) for fmt in ("bf16", "fp16") for rnd in rounding.ROUNDINGS for scaling in ("tensor",)] + [
    (fmt, rnd, scaling)
    for fmt in ("fp8_e4m3", "fp8_e5m2")
    for rnd in rounding.ROUNDINGS
    for scaling in ("tensor", "channel", "block")
]


def masters(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(1000, 1030, generator=gen) * 0.02  # 1.03M elements: many blocks, a ragged edge
    flat = big.view(-1)
    flat[:2000] = torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64).to(torch.int32).view(
        torch.float32
    )  # every kind of bit pattern: NaN, Inf, subnormals, huge
    flat[2000:2006] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38])
    return {"layers.0.weight": torch.nan_to_num(big, nan=0.0, posinf=1e30, neginf=-1e30), "bias": torch.randn(77)}


@pytest.mark.parametrize(("fmt", "rnd", "scaling"), CASES)
def test_cuda_export_equals_cpu_export(fmt: str, rnd: str, scaling: str) -> None:
    spec = rounding.ExportSpec(fmt, rnd, seed=11, scaling=scaling)
    res_cpu, res_gpu = rounding.Residual(format=fmt, scaling=scaling), rounding.Residual(format=fmt, scaling=scaling)
    for version in (1, 2, 3):  # ef: the residual carries over, on both sides
        state = masters(version)
        on_cpu = rounding.export_state_dict(state, spec, version=version, residual=res_cpu if rnd == "ef" else None,
                                            device="cpu")
        on_gpu = rounding.export_state_dict({n: t.cuda() for n, t in state.items()}, spec, version=version,
                                            residual=res_gpu if rnd == "ef" else None, device="cuda")
        assert on_cpu.keys() == on_gpu.keys()
        for name, expected in on_cpu.items():
            got = on_gpu[name].cpu()
            assert got.dtype == expected.dtype, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), (
                fmt, rnd, scaling, version, name
            )
        if rnd == "ef":
            for name in res_cpu.tensors:
                assert (res_cpu.tensors[name].view("uint32") == res_gpu.tensors[name].view("uint32")).all(), name
