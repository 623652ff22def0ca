"""A LoRA adapter with HF PEFT (real `peft`, real transformers model): the learner pushes its
`PeftModel`'s adapter, computes the served copy itself bit for bit, and another `PeftModel` on the
same base takes each version by `update_module` (PEFT's hot-swap), or refuses one that does not fit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import serving
from tests.engines.engines import PROMPTS, masters
from weightsvc import InferenceClient, LearnerClient, rounding
from weightsvc.integrations.peft import adapter_state, served_adapter
from weightsvc.loaders import Mismatch, update_module
from weightsvc.server.server import BackgroundServer

pytestmark = pytest.mark.engine
SPEC = rounding.ExportSpec("bf16", "sr", seed=5)


def peft_model(rank: int = 8, seed: int = 0) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    base, _ = masters("llama", seed=41)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPTS[0]])).logits


@pytest.fixture(scope="module")
def service() -> Iterator[BackgroundServer]:
    with serving(rounding="sr", seed=5) as srv:
        yield srv


def test_update_module_hot_swaps_the_served_adapter(service: BackgroundServer) -> None:
    learner, follower = peft_model(seed=1), peft_model(seed=2)
    for version in (1, 2):
        with torch.no_grad():  # a training step of the learner's adapter
            for name, p in learner.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.full_like(p, 1e-4 * version))
        tensors, adapter = adapter_state(learner, base_model="tiny-llama")
        with LearnerClient(service.grpc_target) as client:
            client.push(version, tensors, model="peft", adapter=adapter)
        served = served_adapter(tensors, SPEC, version)  # the learner's copy, computed here
        with InferenceClient(service.grpc_target) as client:
            pulled = client.pull("peft", version)
        assert all(torch.equal(pulled[n].view(torch.int16), served[n].view(torch.int16)) for n in served)
        before = logits(follower)
        assert update_module(follower, service.grpc_target, "peft") == version
        params = dict(follower.named_parameters())
        for name, t in served.items():
            key = name.replace(".weight", ".default.weight")
            assert torch.equal(params[key], t.float()), name
        # The learner's forward on the served copy: what the follower now computes.
        on_served = peft_model(seed=3)
        with torch.no_grad():
            for name, p in on_served.named_parameters():
                if "lora_" in name:
                    p.copy_(served[name.replace(".default.weight", ".weight")])
        assert torch.equal(logits(follower), logits(on_served))
        assert not torch.equal(before, logits(follower))


def test_a_version_that_does_not_fit_the_peft_model_is_refused(service: BackgroundServer) -> None:
    tensors, adapter = adapter_state(peft_model(seed=4), base_model="tiny-llama")
    with LearnerClient(service.grpc_target) as client:
        client.push(1, tensors, model="peft-r8", adapter=adapter)
        client.push(1, {n: t.clone() for n, t in masters("llama", seed=41)[1].items()}, model="peft-full")
    small = peft_model(rank=4, seed=5)
    kept = {n: p.clone() for n, p in small.named_parameters()}
    with pytest.raises(Mismatch, match=r"model 'peft-r8' version 1: adapter rank 8 .* has rank 4"):
        update_module(small, service.grpc_target, "peft-r8")
    assert all(torch.equal(p, kept[n]) for n, p in small.named_parameters())
    with pytest.raises(Mismatch):  # a full model's version is not loaded into a PeftModel's names
        update_module(small, service.grpc_target, "peft-full")
