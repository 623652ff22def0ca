"""FSDP2 ranks publish the served copy their all-gather serves (`rank_served`): two CPU ranks (gloo)
each wrap the model with `served_params` and `fully_shard`, and publish their rows of every served
tensor to a real `serve --nixl`, which READs them over NIXL and commits the version. The committed
version is bit for bit the service's own export of the same masters pushed as fp32, and the copy the
ranks' forward ran on.

The ranks meet at a gloo barrier before each call that needs every rank (a publish, a push), so they
arrive together however slowly each process started; the server waits `--push-rank-timeout-s` for them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from tests.conftest import ServeProcess
from tests.helpers import free_port, same_bits
from tests.unit.test_fair_cast import TOKENS, Tiny
from weightsvc import InferenceClient
from weightsvc.errors import NotFound
from weightsvc.integrations.fsdp import ServedVersion, served_params
from weightsvc.rounding import ExportSpec

RANKS = 2
SPEC = ExportSpec("bf16", "sr", seed=0)  # `serve`'s defaults
TIED = {"head.weight": "embed.weight"}


class Gated(Tiny):
    """Tiny with a parameter of one row: under FSDP2 over two ranks, the second holds none of it."""

    def __init__(self) -> None:
        super().__init__(vocab=37)  # 37 rows: the second rank's shard of the embeddings is padded
        self.gate = nn.Parameter(torch.randn(1, 64) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * (1 + self.gate)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm(h))


@pytest.fixture(scope="module")
def copier(nixl_installed: None) -> Iterator[ServeProcess]:
    srv = ServeProcess("--nixl")
    yield srv
    srv.stop()


def _fsdp(spec: ExportSpec) -> tuple[Gated, ServedVersion, list[FSDPModule]]:
    """The model (the same masters on every rank), its served handle, and its FSDP groups."""
    torch.manual_seed(0)
    model = Gated()
    served = served_params(model, spec)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in (model.up, model.down):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    groups = [model.up, model.down, model]
    assert all(isinstance(g, FSDPModule) for g in groups)
    return model, served, groups  # type: ignore[return-value]


def _publish_rank(rank: int, port: int, target: str) -> None:
    from weightsvc import LearnerClient
    from weightsvc.client import Shard
    from weightsvc.client._nixl_publish import _agent
    from weightsvc.integrations.fsdp import rank_served, rank_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        model, served, groups = _fsdp(SPEC)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        _agent()  # (made before the ranks meet: it takes a while)
        with LearnerClient(target) as learner, InferenceClient(target) as puller:
            for step in (1, 2):
                served.version = step
                mine = rank_served(model, version=step)
                assert "head.weight" not in mine  # (tied: once, under its first name)
                assert all(isinstance(s, Shard) and s.data.dtype == torch.bfloat16 for s in mine.values())
                assert mine["gate"].data.numel() == (64 if rank == 0 else 0)  # (every rank declares every tensor)
                dist.barrier()
                info = learner.publish(step, mine, "published", rank=rank, world_size=RANKS, spec=SPEC, tied=TIED)
                assert (info.model, info.version) == ("published", step)
                dist.barrier()
                learner.push(step, rank_shards(model), "pushed", rank=rank, world_size=RANKS, tied=TIED)
                published = puller.pull("published", step)
                # (a) the service's own export of the same fp32 masters, bit for bit
                same_bits(published, puller.pull("pushed", step))
                checksums = [{t.name: t.checksum for t in puller.manifest(m, step).tensors} for m in ("published",
                                                                                                       "pushed")]
                assert checksums[0] == checksums[1]
                # (b) the copy this step's forward runs on: FSDP's all-gathers, by hand
                for group in groups:
                    group.unshard()
                gathered = {**{n: p.detach() for n, p in model.named_parameters()},
                            "head.weight": model.embed.weight.detach()}
                same_bits(gathered, published)
                for group in groups:
                    group.reshard()
                opt.zero_grad()
                model(TOKENS).logsumexp(-1).mean().backward()  # on the served copy; gradients to the masters
                opt.step()
            assert [v.version for v in puller.versions("published")] == [1, 2]
    finally:
        dist.destroy_process_group()


def test_two_fsdp_ranks_publish_the_copy_their_forward_runs_on_bit_for_bit_the_services_export(
        copier: ServeProcess) -> None:
    mp.spawn(_publish_rank, args=(free_port(), copier.target), nprocs=RANKS, join=True)


def _other_spec_rank(rank: int, port: int, target: str) -> None:
    from weightsvc import LearnerClient
    from weightsvc.client._nixl_publish import _agent
    from weightsvc.errors import FailedPrecondition
    from weightsvc.integrations.fsdp import rank_served

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        model, served, _ = _fsdp(ExportSpec("bf16", "sr", seed=3))  # the learner's seed is not the server's
        served.version = 2
        with pytest.raises(ValueError, match=r"tensor '[\w.]+': its all-gather serves version 2, not 1; set "
                                             r"served\.version = 1"):
            rank_served(model, version=1)  # (the copy of another version than the one its forward runs on)
        mine = rank_served(model, version=2)
        _agent()
        dist.barrier()
        with LearnerClient(target) as learner, pytest.raises(FailedPrecondition) as refused:
            learner.publish(2, mine, "other-spec", rank=rank, world_size=RANKS, spec=served.spec, tied=TIED)
        assert f"model 'other-spec' step 2 rank {rank}: " in refused.value.message
        assert "seed 3 (the server's: 0)" in refused.value.message
    finally:
        dist.destroy_process_group()


def test_fsdp_ranks_whose_spec_is_not_the_servers_are_refused_naming_model_step_and_rank(
        copier: ServeProcess) -> None:
    mp.spawn(_other_spec_rank, args=(free_port(), copier.target), nprocs=RANKS, join=True)
    with InferenceClient(copier.target) as client, pytest.raises(NotFound):
        client.versions("other-spec")


def test_rank_served_of_a_module_not_sharded_is_its_served_state_dict() -> None:
    from weightsvc.integrations.fair_cast import served_state_dict
    from weightsvc.integrations.fsdp import rank_served

    torch.manual_seed(0)
    model = Gated()
    expected = served_state_dict(model, SPEC, version=4)
    served_params(model, SPEC, version=4)
    mine = rank_served(model, version=4)
    assert all(type(t) is torch.Tensor for t in mine.values())  # (whole: one process holds every master)
    same_bits({**mine, "head.weight": mine["embed.weight"]}, expected)
    with pytest.raises(ValueError, match="not a served parameter"):
        rank_served(Gated(), version=4)
