"""FSDP2 with each rank's shard Fair Cast before the all-gather: two CPU ranks (gloo) gather the
service's served copy of the masters they push, bit for bit, step after step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import serving
from tests.helpers import free_port, same_bits
from tests.unit.test_fair_cast import TOKENS, Tiny
from weightsvc.rounding import ExportSpec

RANKS = 2


def _rank(rank: int, port: int, target: str, format: str, rounding: str, seed: int, wide: bool) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from weightsvc import InferenceClient, LearnerClient
    from weightsvc.client import Shard
    from weightsvc.integrations.fair_cast import on_served_copy
    from weightsvc.integrations.fsdp import ServedShard, rank_shards, served_params

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        torch.manual_seed(0)
        model = Tiny(vocab=37)  # 37 rows: the second rank's shard of the embeddings is padded
        served = served_params(model, ExportSpec(format, rounding, seed))
        served_dtype = torch.float16 if format == "fp16" else torch.bfloat16
        dtype = torch.float32 if wide else served_dtype  # fp32: the served values widened, exactly
        policy = MixedPrecisionPolicy(param_dtype=dtype)
        for layer in (model.up, model.down):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        assert isinstance(model, FSDPModule) and isinstance(model.up, FSDPModule)
        assert isinstance(model.down, FSDPModule)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        # With fp32 compute, the same steps on one process (`on_served_copy`) give the same gradients.
        torch.manual_seed(0)
        ref = Tiny(vocab=37)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
        spec = ExportSpec(format, rounding, seed)
        with LearnerClient(target) as learner, InferenceClient(target) as puller:
            for step in (1, 2, 3):
                # Each rank pushes its own shard of every master: the flat elements its rows hold.
                parts = rank_shards(model)
                assert all(isinstance(p.to_local(), ServedShard) for p in model.parameters())
                for name, part in parts.items():
                    assert isinstance(part, Shard) and part.shape == tuple(dict(model.named_parameters())[name].shape)
                assert "head.weight" not in parts  # (tied: once, under its first name)
                learner.push(step, parts, model="policy", rank=rank, world_size=RANKS,
                             tied={"head.weight": "embed.weight"})
                pulled = puller.pull("policy", step)
                served.version = step
                groups = [model.up, model.down, model]
                for group in groups:
                    group.unshard()  # the all-gathers every forward makes, by hand
                gathered = {**{n: p.detach() for n, p in model.named_parameters()},
                            "head.weight": model.embed.weight.detach()}
                other = {n: (type(t).__name__, t.dtype) for n, t in gathered.items() if t.dtype != dtype}
                assert not other, other
                same_bits({n: t.to(served_dtype) for n, t in gathered.items()}, pulled)
                if wide:
                    assert all(torch.equal(t, pulled[n].float()) for n, t in gathered.items())
                for group in groups:
                    group.reshard()
                opt.zero_grad()
                model(TOKENS).logsumexp(-1).mean().backward()  # on the served copy; gradients to the shards
                opt.step()
                if wide:
                    ref_opt.zero_grad()
                    with on_served_copy(ref, spec, version=step):
                        ref(TOKENS).logsumexp(-1).mean().backward()
                    ref_opt.step()
                    for name, p in model.named_parameters():
                        rows = -(-p.shape[0] // RANKS)
                        grad = p.grad.to_local()
                        expected = dict(ref.named_parameters())[name].grad[rank * rows : rank * rows + grad.shape[0]]
                        gap = (grad - expected).abs().max()
                        assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-7), (name, gap)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("format", "rounding", "seed", "wide"), [
    ("bf16", "sr", 3, False), ("bf16", "rtn", 0, False), ("bf16", "sr", 5, True), ("fp16", "sr-sticky", 1, False)])
def test_two_ranks_gather_the_services_served_copy(format: str, rounding: str, seed: int, wide: bool) -> None:
    """`wide`: FSDP's param_dtype fp32, the gathered bf16 copied into the unsharded parameter."""
    with serving(format=format, rounding=rounding, seed=seed) as srv:
        mp.spawn(_rank, args=(free_port(), srv.grpc_target, format, rounding, seed, wide), nprocs=RANKS, join=True)


def test_scaled_formats_and_ef_are_refused_before_sharding() -> None:
    from weightsvc.integrations.fsdp import served_params

    with pytest.raises(ValueError, match="scaled format's scales come from the whole tensor"):
        served_params(Tiny(), ExportSpec("fp8_e4m3", "sr"))
    with pytest.raises(ValueError, match="rounding 'ef'"):
        served_params(Tiny(), ExportSpec("bf16", "ef"))


def test_rank_shards_of_a_module_not_sharded_are_its_masters_once() -> None:
    from weightsvc.integrations.fsdp import rank_shards

    model = Tiny()
    parts = rank_shards(model)
    assert "head.weight" not in parts and parts.keys() == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(parts[n], p) for n, p in model.named_parameters())
