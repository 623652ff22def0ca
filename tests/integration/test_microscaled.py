"""The microscaled formats through the service: mxfp8, nvfp4 and mxfp4 are exported, committed,
pulled whole and as deltas over gRPC and HTTP, and loaded into a torch module; the served bits are
exactly what `rounding.export_state_dict` computes on the learner's side, over an ef chain that
survives a restart and a version pushed by two ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import serving
from tests.helpers import REDIS_URL, bits, needs_redis, push_ranks
from weightsvc import InferenceClient, LearnerClient, rounding
from weightsvc.client import Shard, dequantize
from weightsvc.loaders import update_module
from weightsvc.protocol.topology import assign

MICRO = ("mxfp8", "nvfp4", "mxfp4")


def llama_layer(seed: int = 0) -> dict[str, torch.Tensor]:
    """One decoder layer's masters, named as Llama's: q/k/v and gate/up are fused by engines (k has a
    larger range than q and v, so a shared NVFP4 global scale differs from its own)."""
    gen = torch.Generator().manual_seed(seed)
    masters = {f"model.layers.0.self_attn.{p}.weight": torch.randn(64, 64, generator=gen) * (0.08 if p == "k_proj"
               else 0.02) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    masters |= {f"model.layers.0.mlp.{p}.weight": torch.randn(96, 64, generator=gen) * 0.02
                for p in ("gate_proj", "up_proj")}
    masters["model.layers.0.mlp.down_proj.weight"] = torch.randn(64, 96, generator=gen) * 0.02
    masters["model.embed_tokens.weight"] = torch.randn(50, 64, generator=gen)
    masters["model.layers.0.input_layernorm.weight"] = torch.ones(64)
    masters["model.odd.weight"] = torch.randn(8, 40, generator=gen) * 0.02  # rows not a multiple of the block: bf16
    return masters


def steps(masters: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        masters = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in masters.items()}
        out.append(masters)
    return out


def served_bits(served: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: bits(t).tobytes() for n, t in served.items()}


class Module(torch.nn.Module):
    def __init__(self, masters: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = list(masters)
        for i, (_, t) in enumerate(masters.items()):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(t.shape)))

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {name: p.data for name, p in zip(self.names, self.parameters(), strict=True)}


@pytest.mark.parametrize("rnd", ["sr", "ef"])
@pytest.mark.parametrize("fmt", MICRO)
def test_microscaled_push_pull_delta_and_load(fmt: str, rnd: str, model: str, tmp_path: Path) -> None:
    spec = rounding.ExportSpec(fmt, rnd)
    f = rounding.FORMATS[fmt]
    states = steps(llama_layer(), 4)
    residual = rounding.Residual() if rnd == "ef" else None
    expected = [rounding.export_state_dict(state, spec, version=step, residual=residual)
                for step, state in enumerate(states, 1)]
    settings = {"format": fmt, "rounding": rnd, "data_dir": tmp_path / "data"}
    with serving(**settings) as srv:
        for step, state in enumerate(states[:3], 1):
            if step == 2:  # two ranks; the down projection split between them mid-row
                names = list(state)
                down = "model.layers.0.mlp.down_proj.weight"
                flat = state[down].reshape(-1)
                cut = 32 * 96 + 48
                ranks: list[dict[str, torch.Tensor | Shard]] = [
                    {n: state[n] for n in names[:4]} | {down: Shard(flat[:cut], 0, state[down].shape)},
                    {n: state[n] for n in names[4:] if n != down} | {down: Shard(flat[cut:], cut, state[down].shape)},
                ]
                for fut in push_ranks(srv.grpc_target, step, ranks, model):
                    fut.result()
            else:
                with LearnerClient(srv.grpc_target) as learner:
                    learner.push(step, state, model)
            for target in (srv.grpc_target, srv.http_url):
                assert served_bits(InferenceClient(target).pull(model, step)) == served_bits(expected[step - 1])
        manifest = InferenceClient(srv.grpc_target).manifest(model, 3)
        layout = rounding.served_tensors("model.layers.0.self_attn.q_proj.weight", (64, 64), f)
        listed = {t.name: (t.shape, t.dtype) for t in manifest.tensors}
        assert all(listed[name] == (shape, dtype) for name, shape, dtype in layout)
        assert listed["model.odd.weight"][1] == "BF16" and listed["model.embed_tokens.weight"][1] == "BF16"
        # The lag metrics take each element (a nibble of a packed byte) as the unit.
        assert manifest.lag is not None and manifest.lag.exact
        assert manifest.lag.sampled_elements == sum(t.numel() for t in states[0].values())
        assert 0 < manifest.lag.churn < 1
        # A delta pull from version 1 gives version 3's bytes.
        with InferenceClient(srv.grpc_target) as puller:
            puller.pull(model, 1)
            delta = puller.pull(model, 3, base=1)
            assert puller.last_pull_bytes < manifest.data_bytes  # (sent as changes)
            assert served_bits(delta) == served_bits(expected[2])
        # Loaded into a module: each master tensor's values, fp4 unpacked and scaled.
        module = Module(states[0])
        assert update_module(module, srv.grpc_target, model, 3) == 3
        values = dequantize(expected[2])
        for name, p in module.state_dict().items():
            assert torch.equal(p, values[name].float()), name
    # Restarted on its data dir: the ef chain goes on from the residual it kept.
    with serving(**settings) as srv:
        with LearnerClient(srv.grpc_target) as learner:
            learner.push(4, states[3], model)
        assert served_bits(InferenceClient(srv.grpc_target).pull(model, 4)) == served_bits(expected[3])


def test_nvfp4_layers_an_engine_fuses_share_one_global_scale(model: str) -> None:
    """q, k and v (and gate and up) are served with one global scale, that of their largest value:
    an engine keeps one per fused layer. The others keep their own."""
    masters = llama_layer()
    with serving(format="nvfp4", rounding="sr") as srv:
        with LearnerClient(srv.grpc_target) as learner:
            learner.push(1, masters, model)
        served = InferenceClient(srv.grpc_target).pull(model, 1)

    def gs(name: str) -> float:
        return float(served[name + "_global_scale"])

    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    qkv = [masters[f"{attn}{p}_proj.weight"].abs().max() for p in "qkv"]
    assert {gs(f"{attn}{p}_proj.weight") for p in "qkv"} == {float(np.float32(2688) / np.float32(max(qkv)))}
    assert gs(f"{attn}q_proj.weight") != float(np.float32(2688) / np.float32(qkv[0]))  # not q's own
    assert gs(f"{mlp}gate_proj.weight") == gs(f"{mlp}up_proj.weight")
    o_proj = masters[f"{attn}o_proj.weight"].abs().max()
    assert gs(f"{attn}o_proj.weight") == float(np.float32(2688) / np.float32(o_proj))


@needs_redis
def test_nvfp4_sharded_equals_one_server(redis_prefix: str, model: str) -> None:
    """Sharded over three replicas, each fused layer on one replica (it computes the shared global
    scale): the same bits as one server, over an ef chain."""
    shared = {"redis_url": REDIS_URL, "redis_prefix": redis_prefix, "format": "nvfp4", "rounding": "ef",
              "replication": 1}
    masters = llama_layer() | {k.replace("layers.0", "layers.1"): v for k, v in llama_layer(1).items()}
    with serving(**shared, replica_id="r0") as r0, serving(**shared, replica_id="r1") as r1, \
            serving(**shared, replica_id="r2") as r2, serving(format="nvfp4", rounding="ef") as alone:
        owned = assign(masters, InferenceClient(r0.grpc_target).topology(), 1)
        for names in owned.values():
            for layer in ("layers.0", "layers.1"):
                qkv = {n for n in masters if layer in n and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}
                assert qkv <= set(names) or not qkv & set(names)
        with LearnerClient(r1.grpc_target) as learner, LearnerClient(alone.grpc_target) as single:
            for step, state in enumerate(steps(masters, 3), 1):
                learner.push(step, state, model)
                single.push(step, state, model)
        expected = served_bits(InferenceClient(alone.grpc_target).pull(model, 3))
        for srv in (r0, r1, r2):
            assert served_bits(InferenceClient(srv.grpc_target).pull(model, 3)) == expected
