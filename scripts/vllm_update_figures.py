"""U1 and U2: how long a real `vllm serve` engine followed by `weightsvc follow` is paused, and how
long a whole update takes, on each path into the engine.

- U1: the pause window over the whole update (push commit -> the follower's ack, the engine serving
  the version): target <= 0.2 on the `transfer` path, whose workers stage the bytes before the pause.
- U2: the whole update over the raw-TCP bound of moving the served bytes once (two Python processes
  on loopback, `weightsvc bench`'s baseline): target <= 2.
The same for the `collective_rpc` path (the worker extension pulls inside the pause), for comparison.

One engine serves both paths (started with weightsvc's backend and its worker extension); the model
is a random Llama of about 1 GB in bf16 (about 1 s or more to pull here). Run in the engine
environment (scripts/setup_engines.sh), from the repository root:

    $(scripts/setup_engines.sh | tail -n 1)/bin/python scripts/vllm_update_figures.py [--layers 8] [--repeat 3]
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

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engines.engines import save_tokenizer
from tests.engines.serving import BACKEND, FollowProcess, VllmServer
from weightsvc import LearnerClient
from weightsvc.cli._server import ServeProcess
from weightsvc.cli.bench.rawtcp import raw_tcp_seconds


def model(layers: int, hidden: int, path: Path) -> dict[str, torch.Tensor]:
    """A random Llama's fp32 masters, and its bf16 checkpoint (the engine's start) in `path`."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    module = LlamaForCausalLM(config)
    module.to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(path)  # (a word-level tokenizer: the engine needs one, the figures do not read it)
    return {n: t.float() for n, t in module.state_dict().items()}


def path_figures(engine: VllmServer, server: ServeProcess, learner: LearnerClient, masters: dict[str, torch.Tensor],
                 path: str, first: int, repeat: int, tcp_s: float) -> tuple[dict[str, float], int]:
    follower = FollowProcess(engine, server.target, "policy", "--path", path, "--client-id", path,
                             "--update-timeout-s", "1200")
    try:
        follower.wait_for("connected", timeout=120)
        learner.push(first, masters, model="policy")  # one update before the timed ones
        follower.wait_for("update", first, timeout=1200)
        whole, pause, stage = [], [], []
        for version in range(first + 1, first + 1 + repeat):
            learner.push(version, masters, model="policy")  # returns once committed
            committed = time.monotonic()
            stage.append(float(follower.wait_for("staged", version, timeout=1200)["stage_s"]))
            event = follower.wait_for("update", version, timeout=1200)
            whole.append(time.monotonic() - committed)
            pause.append(float(event["pause_s"]))
    finally:
        follower.stop()
    w, p = statistics.median(whole), statistics.median(pause)
    return {"update_s": round(w, 3), "stage_s": round(statistics.median(stage), 3), "pause_s": round(p, 3),
            "U1": round(p / w, 3), "U2": round(w / tcp_s, 2)}, first + 1 + repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3, help="timed updates per path (the median is kept)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        start = Path(tmp) / "v0"
        masters = model(args.layers, args.hidden, start)
        server = ServeProcess("--retain", "2", "--log-level", "warning", capture_stderr=False)
        engine = VllmServer(start, Path(tmp) / "engine.log", "--weight-transfer-config", BACKEND,
                            "--worker-extension-cls", "weightsvc.loaders.VllmWorkerExtension", max_model_len=256)
        try:
            with LearnerClient(server.target) as learner:
                info = learner.push(1, masters, model="policy")
                tcp_s = min(raw_tcp_seconds(info.data_bytes, download=True) for _ in range(3))
                engine.wait_ready()
                figures: dict[str, object] = {"served_bytes": info.data_bytes, "raw_tcp_s": round(tcp_s, 3),
                                              "cpus": os.cpu_count()}
                version = 2
                for path in ("transfer", "collective_rpc"):
                    figures[path], version = path_figures(engine, server, learner, masters, path, version,
                                                          args.repeat, tcp_s)
        finally:
            engine.stop()
            server.stop()
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
