"""LoRA adapter versions in an in-process vLLM `LLM` (`enable_lora=True`): `LlmAdapters` keeps the
newest revisions of an adapter model loaded, each generating what a static adapter made of its
pulled served copy generates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import serving
from tests.engines.engines import PROMPTS, checkpoint, engine, masters
from tests.engines.test_vllm_lora import AdapterPolicy
from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import Adapter
from weightsvc.loaders import LlmAdapters, Mismatch

pytestmark = pytest.mark.engine


def generate(llm: Any, lora_request: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in out]


def test_llm_keeps_the_newest_revisions_each_as_its_served_copy(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    module, _ = masters("llama", seed=43)
    base = checkpoint(module, tmp_path / "base")
    policy = AdapterPolicy(module, seed=3)
    with serving(rounding="sr") as service, LearnerClient(service.grpc_target) as learner, \
            engine(base, enable_lora=True, max_lora_rank=8, max_loras=2) as llm:
        adapters = LlmAdapters(llm, service.grpc_target, "pol", adapter_dir=tmp_path / "revisions", max_live=2)
        outputs = {}
        for v in (1, 2, 3):
            tensors, adapter = policy.at(v, base)
            learner.push(v, tensors, model="pol", adapter=adapter)
            assert adapters.update() == v
            outputs[v] = generate(llm, adapters.request())
        assert sorted(adapters.live) == [2, 3] and len(llm.llm_engine.list_loras()) == 2
        assert sorted(p.name for p in (tmp_path / "revisions").iterdir()) == ["pol@v2", "pol@v3"]
        assert generate(llm, adapters.request(2)) == outputs[2] != outputs[3]
        ref = tmp_path / "ref"
        ref.mkdir()
        with InferenceClient(service.grpc_target) as client:
            client.pull_file(ref / "adapter_model.safetensors", "pol", 3)
        policy.peft.peft_config["default"].save_pretrained(str(ref))
        assert generate(llm, LoRARequest("ref", 1000, str(ref))) == outputs[3]
        learner.push(4, tensors, model="pol", adapter=Adapter("another-base", 8, 16.0, adapter.target_modules))
        with pytest.raises(Mismatch, match=r"model 'pol' version 4: its base is 'another-base'"):
            adapters.update()
        assert sorted(adapters.live) == [2, 3]
