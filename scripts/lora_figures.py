"""LoRA adapter versions against full-model versions of the same base: the bytes each version
pushes (fp32 masters) and pulls (the served copy whole, and as a delta on the version before), and
the time from the learner's push (committed) to a real `vllm serve` engine serving it (`weightsvc
follow`: the adapter loaded as `MODEL@vN` with `--max-live 2`; the full model swapped in place on
the `transfer` path). Prints JSON.

One engine (`--enable-lora` and weightsvc's weight-transfer backend) serves both; the base is a random
Llama (default about 120 M parameters), the adapter rank 16 on q, k, v and o. Each version moves the
masters by one small step, as training does. Run in the engine environment (scripts/setup_engines.sh),
from the repository root:

    $(scripts/setup_engines.sh | tail -n 1)/bin/python scripts/lora_figures.py [--layers 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engines.engines import save_tokenizer
from tests.engines.serving import BACKEND, FollowProcess, VllmServer
from weightsvc import InferenceClient, LearnerClient
from weightsvc.cli._server import ServeProcess
from weightsvc.integrations.peft import adapter_state

LR = 1e-5  # the step each version takes, relative to each tensor's scale


def stepped(masters: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The masters after `version` steps of sign-like updates (an Adam step: about lr per element)."""
    g = torch.Generator().manual_seed(version)
    return {n: t + LR * t.abs().mean() * version * torch.randn(t.shape, generator=g).sign()
            for n, t in masters.items()}


def kind_figures(server: ServeProcess, learner: LearnerClient, follower: FollowProcess, model: str,
                 masters: dict[str, torch.Tensor], event: str, repeat: int, **push: Any) -> dict[str, Any]:
    """Push `repeat` + 1 versions (the first untimed), each waited for in the engine; the bytes and times."""
    learner.push(1, stepped(masters, 1), model=model, **push)
    follower.wait_for(event, 1, timeout=1200)
    times, full, delta = [], [], []
    with InferenceClient(server.target) as client:
        client.pull(model, 1)
        for version in range(2, repeat + 2):
            learner.push(version, stepped(masters, version), model=model, **push)
            committed = time.monotonic()
            follower.wait_for(event, version, timeout=1200)
            times.append(time.monotonic() - committed)
            client.pull(model, version, base=version - 1)
            delta.append(client.last_pull_bytes)
            client.pull(model, version)
            full.append(client.last_pull_bytes)
    return {"pushed_bytes": sum(t.numel() * 4 for t in masters.values()), "pulled_bytes": statistics.median(full),
            "pulled_delta_bytes": statistics.median(delta), "push_to_serving_s": round(statistics.median(times), 3),
            "tensors": len(masters)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounding", default="sr")
    parser.add_argument("--repeat", type=int, default=3, help="timed versions of each kind (the median is kept)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                         num_key_value_heads=args.hidden // 128, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    module = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as tmp:
        start = Path(tmp) / "base"
        module.to(torch.bfloat16).save_pretrained(start)
        save_tokenizer(start)
        module.float()
        full = {n: t.detach().clone() for n, t in module.state_dict().items()}
        peft = get_peft_model(module, LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        with torch.no_grad():  # B trained away from PEFT's zeros
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
        lora, adapter = adapter_state(peft, base_model=str(start))
        server = ServeProcess("--retain", "3", "--rounding", args.rounding, "--log-level", "warning",
                              capture_stderr=False)
        engine = VllmServer(start, Path(tmp) / "engine.log", "--weight-transfer-config", BACKEND, "--enable-lora",
                            "--max-lora-rank", str(args.rank), max_model_len=256,
                            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
        followers: list[FollowProcess] = []
        try:
            engine.wait_ready()
            with LearnerClient(server.target) as learner:
                followers.append(FollowProcess(engine, server.target, "policy-lora", "--max-live", "2",
                                               "--adapter-dir", str(Path(tmp) / "revisions")))
                figures: dict[str, Any] = {"rounding": args.rounding, "cpus": os.cpu_count()}
                figures["adapter"] = kind_figures(server, learner, followers[-1], "policy-lora", lora, "loaded",
                                                  args.repeat, adapter=adapter)
                followers.append(FollowProcess(engine, server.target, "policy", "--path", "transfer",
                                               "--update-timeout-s", "1200"))
                figures["full"] = kind_figures(server, learner, followers[-1], "policy", full, "update", args.repeat)
        finally:
            for f in followers:
                f.stop()
            engine.stop()
            server.stop()
    a, f = figures["adapter"], figures["full"]
    figures["adapter_over_full"] = {k: round(a[k] / f[k], 6) for k in
                                    ("pushed_bytes", "pulled_bytes", "pulled_delta_bytes", "push_to_serving_s")}
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
