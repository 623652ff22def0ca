"""On a CUDA machine: the learner's served copy computed where its masters live (the Triton kernels)
is the CPU's, bit for bit: a shard at its offset (what an FSDP rank rounds before the all-gather)
and a whole module (`served_state_dict`). Elsewhere these tests skip."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_fair_cast import tiny
from weightsvc.integrations.fair_cast import served_state_dict
from weightsvc.rounding import ExportSpec, fair_cast

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch sees no CUDA device")


@pytest.mark.parametrize(("format", "rounding"), [("bf16", "sr"), ("bf16", "rtn"), ("fp16", "sr-sticky")])
def test_a_shard_on_the_gpu_rounds_as_the_whole_tensor_on_the_cpu(format: str, rounding: str) -> None:
    master = torch.randn(1001, 96, generator=torch.Generator().manual_seed(0)) * 0.02
    whole = fair_cast(master, format=format, rounding=rounding, seed=4, version=9, name="w")
    rows = 501  # rank 1 of 2: rows [501, 1001), from flat element 501 * 96
    shard = fair_cast(master[rows:].cuda(), format=format, rounding=rounding, seed=4, version=9, name="w",
                      offset=rows * 96)
    assert shard.device.type == "cuda"
    assert torch.equal(shard.cpu().view(torch.int16), whole[rows:].view(torch.int16))


@pytest.mark.parametrize(("format", "rounding"), [("bf16", "sr"), ("fp8_e4m3", "sr")])
def test_a_module_on_the_gpu_serves_the_cpus_bits(format: str, rounding: str) -> None:
    spec = ExportSpec(format, rounding, seed=1)
    on_cpu = served_state_dict(tiny(), spec, version=3)
    on_gpu = served_state_dict(tiny().cuda(), spec, version=3)
    for name, t in on_cpu.items():
        assert torch.equal(on_gpu[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
