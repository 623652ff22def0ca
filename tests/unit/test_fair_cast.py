"""The learner's half of Fair Cast, without a service: the served copy recomputed from a module, and
the forward and backward run on it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import bits
from weightsvc.client import dequantize
from weightsvc.integrations.fair_cast import on_served_copy, served_state_dict
from weightsvc.rounding import ExportSpec, Residual, fair_cast


class Tiny(nn.Module):
    """Embeddings tied to the output head, a hidden layer, a norm: the shapes an LM has."""

    def __init__(self, vocab: int = 37, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, 128)
        self.down = nn.Linear(128, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm(h))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


TOKENS = torch.arange(24).reshape(4, 6) % 37


def loaded(module: Tiny, served: dict[str, torch.Tensor]) -> Tiny:
    """An independent reference: a copy of the module whose fp32 parameters hold the served values."""
    ref = copy.deepcopy(module)
    values = dequantize(served)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(values[name].float())
    return ref


def test_the_served_state_dict_is_fair_cast_of_each_master_with_ties_once() -> None:
    m = tiny()
    served = served_state_dict(m, ExportSpec("bf16", "sr", seed=5), version=7)
    assert served["head.weight"] is served["embed.weight"]
    for name, master in m.state_dict().items():
        kept = "embed.weight" if name == "head.weight" else name  # a tie is served under its first name
        assert np.array_equal(bits(served[name]), bits(fair_cast(master, rounding="sr", seed=5, version=7, name=kept)))


@pytest.mark.parametrize(("format", "rounding"), [("bf16", "sr"), ("bf16", "rtn"), ("fp8_e4m3", "sr"),
                                                   ("mxfp4", "sr-sticky")])
def test_forward_and_gradients_are_those_of_the_served_values_on_the_masters(format: str, rounding: str) -> None:
    m = tiny()
    spec = ExportSpec(format, rounding, seed=3)
    params = dict(m.named_parameters())
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    ref = loaded(m, served_state_dict(m, spec, version=4))
    assert not all(torch.equal(p, params[n]) for n, p in ref.named_parameters())  # the copy is not the masters
    with on_served_copy(m, spec, version=4) as policy:
        out = policy(TOKENS)
        out.square().mean().backward()
        assert torch.equal(policy.head.weight, ref.head.weight)  # read outside forward: the served copy too
    expected = ref(TOKENS)
    expected.square().mean().backward()
    assert torch.equal(out, expected)
    for name, p in ref.named_parameters():
        assert params[name].grad is not None and torch.equal(params[name].grad, p.grad), name
    # Outside the context: the same Parameter objects, the masters' values and names.
    assert dict(m.named_parameters()) == params
    assert list(m.state_dict()) == list(before)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())


def test_forwards_accumulate_and_bf16_compute_matches_autocast() -> None:
    m = tiny()
    spec = ExportSpec("bf16", "sr")
    up = m.up.weight
    with on_served_copy(m, spec, version=1):
        m(TOKENS).sum().backward()
        assert up.grad is not None
        once = up.grad.clone()
        m(TOKENS).sum().backward()
    assert torch.equal(up.grad, 2 * once)
    x = torch.randn(8, 64)
    with torch.autocast("cpu", torch.bfloat16):
        with on_served_copy(m, spec, version=1):
            wide = m.up(x)
        with on_served_copy(m, spec, version=1, dtype=torch.bfloat16):
            assert m.up.weight.dtype == torch.bfloat16
            narrow = m.up(x)
    assert torch.equal(wide, narrow)  # the served bf16 values are exact in fp32: autocast's cast changes nothing


def test_ef_advances_the_learners_residual_once_per_version() -> None:
    m = tiny()
    spec = ExportSpec("bf16", "ef")
    with pytest.raises(ValueError, match="pass the learner's Residual"):
        served_state_dict(m, spec, version=1)
    residual = Residual()
    first = served_state_dict(m, spec, version=1, residual=residual)
    assert residual.version == 1
    with pytest.raises(ValueError, match="residual is at version 1; version 1"):
        served_state_dict(m, spec, version=1, residual=residual)
    # The residual is master - served, exactly (fp32); the next version rounds m + e.
    up = m.up.weight.detach()
    kept = torch.from_numpy(residual.tensors["up.weight"]).reshape(up.shape)
    assert torch.equal(kept, up - first["up.weight"].float())


def test_a_module_without_a_served_tensor_is_refused_untouched() -> None:
    m = tiny()
    served = served_state_dict(m, ExportSpec(), version=1)
    del served["down.bias"]
    from weightsvc.client import served_weights

    with pytest.raises(KeyError, match=r"down\.bias"), served_weights(m, served):
        pass
    assert not any("parametrizations" in k for k in m.state_dict())
    with on_served_copy(m, ExportSpec(), version=1), pytest.raises(ValueError, match="parametrized already"), \
            on_served_copy(m, ExportSpec(), version=1):
        pass
