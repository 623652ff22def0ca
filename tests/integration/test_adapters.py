"""LoRA adapter versions on the service: the base and PEFT config from the push header in the
manifest (gRPC, HTTP, the data dir), the tensors checked against them, served unscaled under the
version's rounding (bit for bit `served_adapter`), pulled whole, as a delta and sliced."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import TRANSPORTS, serving, target
from tests.helpers import REDIS_URL, bits, needs_redis, push_ranks
from weightsvc import InferenceClient, LearnerClient, rounding
from weightsvc.client import Adapter, Shard, Slice
from weightsvc.errors import FailedPrecondition, InvalidArgument, NotFound
from weightsvc.integrations.peft import served_adapter
from weightsvc.protocol.adapter import parse_revision, revision

RANK, IN, OUT = 8, 64, 96
ADAPTER = Adapter("policy-base", RANK, 16.0, ("q_proj", "v_proj"), base_version=7, base_digest="xxh3_128:ab")
PREFIX = "base_model.model.model.layers"


def masters(version: int, layers: int = 2) -> dict[str, torch.Tensor]:
    """An adapter's fp32 masters under PEFT's names; B small, as training leaves it."""
    g = torch.Generator().manual_seed(version)
    out = {}
    for i in range(layers):
        for m in ADAPTER.target_modules:
            out[f"{PREFIX}.{i}.self_attn.{m}.lora_A.weight"] = torch.randn(RANK, IN, generator=g) * 0.05
            out[f"{PREFIX}.{i}.self_attn.{m}.lora_B.weight"] = torch.randn(OUT, RANK, generator=g) * 1e-3
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_adapter_version_served_unscaled_bit_for_bit_with_its_config(transport: str, tmp_path: Path) -> None:
    spec = rounding.ExportSpec("fp8_e4m3", "sr", seed=3)
    with serving(format="fp8_e4m3", rounding="sr", seed=3, data_dir=tmp_path / "data") as srv:
        with LearnerClient(target(srv, transport)) as learner:  # pushed over the transport too
            for v in (1, 2):
                learner.push(v, masters(v), model="ad", adapter=ADAPTER)
            learner.push(1, masters(1), model="full")  # the same tensors as a full model: fp8 where 2-D
        with InferenceClient(target(srv, transport)) as client:
            m = client.manifest("ad", 2)
            assert m.adapter == ADAPTER and m.format == "bf16" and m.rounding == "sr"
            served = client.pull("ad", 2)
            expected = served_adapter(masters(2), spec, version=2)
            assert served.keys() == expected.keys()
            for name, t in expected.items():
                assert t.dtype == torch.bfloat16 and np.array_equal(bits(served[name]), bits(t)), name
            assert client.manifest("full", 1).format == "fp8_e4m3" and client.manifest("full", 1).adapter is None
            client.pull("ad", 1)
            delta = client.pull("ad", 2, base=1)
            assert all(np.array_equal(bits(delta[n]), bits(served[n])) for n in served)
            name = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"
            part = client.pull("ad", 2, select={name: Slice(0, 0, OUT // 2)})
            assert np.array_equal(bits(part[name]), bits(served[name][: OUT // 2]))
    with serving(data_dir=tmp_path / "data") as srv, InferenceClient(srv.grpc_target) as client:
        assert client.manifest("ad", 2).adapter == ADAPTER  # restored from the data dir with its config


@pytest.mark.parametrize(("tensors", "message"), [
    ({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)}, "is not a LoRA weight"),
    ({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": torch.zeros(RANK, IN)}, "outside target_modules"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, IN),
      f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(OUT, 4)}, "rank 8"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(RANK, IN)}, "has no lora_B.weight"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(()),  # (was INTERNAL: shape[0] of a scalar)
      f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(OUT, RANK)}, r"lora_A.weight' has shape \[\]"),
    ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(RANK, IN),
      f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(())}, r"lora_B.weight' has shape \[\]"),
])
def test_tensors_that_are_not_the_adapter_are_refused_by_name(tensors: dict[str, torch.Tensor], message: str,
                                                              push_transport: str) -> None:
    """Refused by name over either push transport (a LoRA tensor of shape [] was INTERNAL over gRPC,
    500 over HTTP)."""
    with serving() as srv, LearnerClient(target(srv, push_transport)) as learner:
        with pytest.raises(InvalidArgument, match=message) as e:
            learner.push(1, tensors, model="ad", adapter=ADAPTER)
        assert "model 'ad' step 1" in str(e.value)
        with pytest.raises(InvalidArgument, match="rank 0 is not in"):
            learner.push(1, masters(1), model="ad", adapter=Adapter("b", 0, 1.0, ("q_proj",)))
        with pytest.raises(InvalidArgument, match="names its base"):
            learner.push(1, masters(1), model="ad", adapter=Adapter("", RANK, 1.0, ("q_proj", "v_proj")))
        with pytest.raises(NotFound):  # nothing half-recorded
            srv.service.versions("ad")


def test_ranks_push_one_adapter_and_must_declare_the_same() -> None:
    whole = masters(1)
    names = sorted(whole)
    parts: list[dict[str, torch.Tensor | Shard]] = [{n: whole[n] for n in names[::2]},
                                                    {n: whole[n] for n in names[1::2]}]
    with serving() as srv:
        for f in push_ranks(srv.grpc_target, 1, parts, "ad", adapter=ADAPTER):
            assert f.result(60).version == 1
        with InferenceClient(srv.grpc_target) as client:
            assert client.manifest("ad", 1).adapter == ADAPTER
        other = Adapter(ADAPTER.base_model, RANK, 32.0, ADAPTER.target_modules)
        with LearnerClient(srv.grpc_target) as a, LearnerClient(srv.grpc_target) as b:
            pool = ThreadPoolExecutor(1)
            rank0 = pool.submit(a.push, 2, parts[0], "ad", rank=0, world_size=2, adapter=ADAPTER)
            srv.call(srv.service.wait_for(lambda: bool(srv.service.pushes.joining)))
            with pytest.raises(InvalidArgument, match=r"rank 1: adapter .*alpha=32.0.*but the other ranks declared"):
                b.push(2, parts[1], "ad", rank=1, world_size=2, adapter=other)
            info = b.push(2, parts[1], "ad", rank=1, world_size=2, adapter=ADAPTER)
            pool.shutdown(wait=True)
            assert rank0.result() == info


@pytest.mark.parametrize("push_transport", TRANSPORTS)
def test_a_model_takes_pushes_of_its_own_kind_only(push_transport: str) -> None:
    """An adapter model's versions are all the adapter's, a whole model's all whole: a push of the other
    kind is refused naming the model, and the model keeps what it holds."""
    with serving() as srv, LearnerClient(target(srv, push_transport)) as learner:
        learner.push(1, masters(1), model="ad", adapter=ADAPTER)
        learner.push(1, masters(1), model="full")
        with pytest.raises(FailedPrecondition, match=r"model 'ad' step 2: the model's versions are a LoRA adapter of "
                                                     r"base 'policy-base' \(latest: version 1\), and this push "
                                                     "declares no adapter"):
            learner.push(2, masters(2), model="ad")
        with pytest.raises(FailedPrecondition, match=r"model 'full' step 2: the model's versions are whole \(latest: "
                                                     r"version 1\), and this push declares an adapter of base "
                                                     "'policy-base'"):
            learner.push(2, masters(2), model="full", adapter=ADAPTER)
        with InferenceClient(srv.grpc_target) as client:
            assert [m.version for m in client.versions("ad")] == [1] == [m.version for m in client.versions("full")]
        assert learner.push(2, masters(2), model="ad", adapter=ADAPTER).created


def test_revision_names() -> None:
    assert revision("pol", 12) == "pol@v12"
    assert parse_revision("pol@v12") == ("pol", 12)
    assert parse_revision("a@vb@v3") == ("a@vb", 3)
    assert parse_revision("pol") is None and parse_revision("pol@latest") is None


@needs_redis
def test_sharded_replicas_serve_an_adapter_as_one_server_does(redis_prefix: str) -> None:
    """Over sharded replicas each owns some of the adapter's tensors (an A apart from its B), and the
    version's manifest carries the adapter everywhere."""
    state = masters(1, layers=4)
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "rounding": "sr", "replication": 1}
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1, \
            serving(rounding="sr") as alone:
        for srv in (r0, alone):
            with LearnerClient(srv.grpc_target) as learner:
                learner.push(1, state, model="ad", adapter=ADAPTER)
        with InferenceClient(r1.grpc_target) as client, InferenceClient(alone.grpc_target) as single:
            merged = client.manifest("ad", 1)
            assert merged.adapter == ADAPTER and [p.owner for p in merged.parts] == ["r0", "r1"]
            sharded, whole = client.pull("ad", 1), single.pull("ad", 1)
            assert all(np.array_equal(bits(sharded[n]), bits(whole[n])) for n in whole)
        for srv in (r0, r1):  # each holds a part of it, under the adapter
            held = srv.service.index.get("ad", 1)
            assert held.manifest.adapter == ADAPTER and 0 < sum(s.nbytes for s in held.spans) < merged.data_bytes
