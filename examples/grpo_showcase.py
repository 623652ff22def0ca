"""Fair Cast in a real RL loop: TRL's GRPO trains a tiny causal LM (built here, nothing from a hub) to
emit even token ids, with rollouts from a real `vllm serve` that follows weightsvc, once per rounding
mode; it prints the service's served lag, the reward curve (steps to a threshold, area under it) and
the learner-vs-engine mismatch by weight version (k3 with the learner on its served copy, as trained,
and, as diagnostics, on its fp32 masters and on a round-to-nearest copy of them), as a table (`--json`: JSON) and a PNG.

    .venv/bin/python examples/grpo_showcase.py --steps 60 --png showcase.png

The trainer runs here (the `trl` extra); `vllm serve` runs in the engines venv (scripts/setup_engines.sh,
or --engine-python) and `weightsvc follow` keeps it on the latest version. `train` runs one mode
against a service and an engine that are already up (the engine tests use it).

The tiny model's output head sits on a common offset (which softmax cancels): its weights are then as
large against one Adam step as a pretrained model's are at a fine-tuning learning rate, which is the
regime in which round-to-nearest hides the updates, while the model still learns within a minute."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
HEAD_OFFSET = 4.0  # bf16 spacing at 4 is 2**-5: half of it is ~80 Adam steps of LR
LR = 2e-4
PROMPT_LEN = 4
COMPLETION_LEN = 4
THRESHOLD = 0.75  # reward (share of even tokens; 0.5 by chance) that counts as learned


def build(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with a word-level tokenizer (tokens `t0`..`t63`), saved in bf16 as an engine loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    module = LlamaForCausalLM(config)
    with torch.no_grad():
        module.lm_head.weight.add_(HEAD_OFFSET)
    module.to(torch.bfloat16).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0",
                            pad_token="t0").save_pretrained(path)
    return path


def even_tokens(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The verifiable reward: the share of a completion's tokens whose id is even."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def train(model_dir: Path, target: str, engine: str, model: str, rounding: str, steps: int, lr: float = LR,
          seed: int = 0, ablate_every: int = 1) -> dict[str, Any]:
    """One GRPO run of `steps` optimizer steps; its trace (per step: reward, lag, mismatch by version)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from weightsvc.integrations.trl import FairCastGRPOTrainer, WeightsvcSync

    g = torch.Generator().manual_seed(seed)
    prompts = [" ".join(["t1", *(f"t{int(t)}" for t in torch.randint(3, VOCAB, (PROMPT_LEN - 1,), generator=g))])
               for _ in range(512)]
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # bf16-exact fp32 masters
    out = tempfile.TemporaryDirectory(prefix="grpo-")
    args = GRPOConfig(output_dir=out.name, max_steps=steps, learning_rate=lr,
                      per_device_train_batch_size=16, num_generations=8, max_completion_length=COMPLETION_LEN,
                      generation_kwargs={"ignore_eos": True}, beta=0.0, temperature=1.0, logging_steps=1,
                      report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=seed,
                      disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0)
    sync = WeightsvcSync(target=target, engine=engine, model=model, rounding=rounding, ablate_every=ablate_every)
    trainer = FairCastGRPOTrainer(model=policy, reward_funcs=even_tokens, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}),
                                  processing_class=AutoTokenizer.from_pretrained(model_dir), sync=sync)
    started = time.monotonic()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # (the trainer prints its summary: stdout is the table's)
            trainer.train()
    finally:
        sync.close()
        out.cleanup()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "rounding": rounding, "steps": steps, "served_from": sync.served_from,
        "seconds": round(time.monotonic() - started, 1), "reward": rewards,
        "is_ratio": [h.get("sampling/importance_sampling_ratio/mean") for h in trainer.state.log_history
                     if "reward" in h],
        "lag": {v: m.lag_steps for v, m in sorted(sync.lag.items())},
        "mismatch": [{"step": step, "by_version": {v: asdict(m) for v, m in by.items()}}
                     for step, by in sync.mismatch],
        "service_mismatch": service_mismatch(target, model),
        "ablation": [{"step": step, "by_copy": {c: asdict(m) for c, m in by.items()}} for step, by in sync.ablation],
    }


def service_mismatch(target: str, model: str) -> dict[int, dict[str, Any]]:
    """The mismatch the service recorded per retained version (every report of it added up)."""
    from weightsvc import InferenceClient

    with InferenceClient(target) as client:
        return {v.version: asdict(v.mismatch) for v in client.versions(model) if v.mismatch is not None}


def summary(trace: dict[str, Any]) -> dict[str, Any]:
    rewards, lag = trace["reward"], [v for k, v in trace["lag"].items() if int(k) > 0]
    window = [sum(rewards[max(0, i - 4): i + 1]) / len(rewards[max(0, i - 4): i + 1]) for i in range(len(rewards))]
    reached = next((i + 1 for i, r in enumerate(window) if r >= THRESHOLD), None)
    diffs = [m for b in trace["mismatch"] for m in b["by_version"].values()]
    tokens = sum(m["tokens"] for m in diffs)
    return {
        "rounding": trace["rounding"],
        "lag_mean": round(sum(lag) / max(1, len(lag)), 2), "lag_max": max(lag, default=0),
        "reward_first5": round(sum(rewards[:5]) / max(1, len(rewards[:5])), 3),
        "reward_last5": round(sum(rewards[-5:]) / max(1, len(rewards[-5:])), 3),
        f"steps_to_{THRESHOLD}": reached, "reward_auc": round(sum(rewards) / max(1, len(rewards)), 3),
        "mismatch_abs_logp": round(sum(m["mean_abs_logp_delta"] * m["tokens"] for m in diffs) / max(1, tokens), 4),
        "mismatch_k3_kl": f"{sum(m['k3_kl'] * m['tokens'] for m in diffs) / max(1, tokens):.1e}",
        **ablation(trace),
        "versions_per_batch": round(sum(len(b["by_version"]) for b in trace["mismatch"])
                                    / max(1, len(trace["mismatch"])), 2),
        "seconds": trace["seconds"],
    }


def ablation(trace: dict[str, Any]) -> dict[str, str]:
    """Token-weighted k3 of the learner on each of its copies against the engine, over the ablated batches."""
    batches = trace.get("ablation") or []
    out = {}
    for copy in ("served", "masters", "rtn copy"):
        ms = [b["by_copy"][copy] for b in batches]
        tokens = sum(m["tokens"] for m in ms)
        out[f"k3 {copy}"] = f"{sum(m['k3_kl'] * m['tokens'] for m in ms) / max(1, tokens):.1e}" if ms else "-"
    return out


def plot(traces: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lag, ax_reward, ax_mis) = plt.subplots(1, 3, figsize=(15, 4))
    for t in traces:
        lag = {int(k): v for k, v in t["lag"].items()}
        ax_lag.plot(sorted(lag), [lag[k] for k in sorted(lag)], label=t["rounding"])
        ax_reward.plot(range(1, len(t["reward"]) + 1), t["reward"], label=t["rounding"])
        ax_mis.plot([b["step"] for b in t["mismatch"]],
                    [max(m["mean_abs_logp_delta"] for m in b["by_version"].values()) for b in t["mismatch"]],
                    label=t["rounding"])
    ax_lag.set(title="served lag (service's metric)", xlabel="version (step)", ylabel="lag (steps)")
    ax_reward.axhline(THRESHOLD, color="grey", lw=0.5)
    ax_reward.set(title="GRPO reward (rollouts from vllm serve)", xlabel="step", ylabel="share of even tokens")
    ax_mis.set(title="learner vs engine |Δ logp| of the batch's version", xlabel="step", ylabel="mean |Δ logp|")
    for ax in (ax_lag, ax_reward, ax_mis):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url, timeout=5).close()
            return
        time.sleep(1.0)  # (a process coming up: nothing to wait on but its port)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@contextlib.contextmanager
def process(command: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_python(given: str | None) -> str:
    if given or os.environ.get("WEIGHTSVC_ENGINE_PYTHON"):
        return given or os.environ["WEIGHTSVC_ENGINE_PYTHON"]
    venv = subprocess.run([str(ROOT / "scripts" / "setup_engines.sh")], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    return f"{venv}/bin/python"


def showcase(args: argparse.Namespace) -> list[dict[str, Any]]:
    from weightsvc.server.server import BackgroundServer
    from weightsvc.settings import Settings

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="grpo-showcase-"))
    print(f"logs, model: {work}", file=sys.stderr)
    model_dir = build(work / "model", args.seed)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    vllm = [engine_python(args.engine_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "64",
            "--enforce-eager", "--seed", str(args.seed), "--enable-scale-out", "--logprobs-mode",
            "processed_logprobs", "--weight-transfer-config", '{"backend": "weightsvc"}']
    traces = []
    with (BackgroundServer(Settings(grpc_port=0, http_port=0, probe_port=0)) as service,
          process(vllm, work / "vllm.log", {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}) as engine):
        _wait_http(f"{url}/health", engine, work / "vllm.log")
        for mode in args.modes.split(","):
            model = f"showcase-{mode}"
            follow = [sys.executable, "-m", "weightsvc", "follow", "--engine", url, "--target", service.grpc_target,
                      "--model", model, "--listen", "127.0.0.1:0", "--client-id", f"follow-{model}"]
            with process(follow, work / f"follow-{mode}.log", {"PYTHONPATH": str(ROOT)}):
                traces.append(train(model_dir, service.grpc_target, url, model, mode, args.steps, args.lr, args.seed,
                                    args.ablate_every))
            print(f"{mode}: {json.dumps(summary(traces[-1]))}", file=sys.stderr)
    return traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("train", help="one mode against a running service and engine")
    one.add_argument("--model-dir", type=Path, required=True)
    one.add_argument("--target", required=True)
    one.add_argument("--engine", required=True)
    one.add_argument("--model", required=True)
    one.add_argument("--rounding", default="sr")
    one.add_argument("--out", type=Path, required=True)
    make = sub.add_parser("build", help="build the tiny model into --model-dir")
    make.add_argument("--model-dir", type=Path, required=True)
    for p in (parser, one, make):
        p.add_argument("--seed", type=int, default=0)
    for p in (parser, one):
        p.add_argument("--steps", type=int, default=60)
        p.add_argument("--lr", type=float, default=LR)
        p.add_argument("--ablate-every", type=int, default=1,
                       help="also measure the mismatch on the masters and an rtn copy, every N steps (0: never)")
    parser.add_argument("--modes", default="rtn,sr,sr-sticky")
    parser.add_argument("--engine-python", default=None, help="python of the engines venv (default: setup_engines.sh)")
    parser.add_argument("--work-dir", type=Path, default=None, help="the model and the logs (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.add_argument("--png", type=Path, default=Path("grpo_showcase.png"))
    args = parser.parse_args()
    if args.command == "build":
        build(args.model_dir, args.seed)
        return
    if args.command == "train":
        trace = train(args.model_dir, args.target, args.engine, args.model, args.rounding, args.steps, args.lr,
                      args.seed, args.ablate_every)
        args.out.write_text(json.dumps(trace))
        return
    started = time.monotonic()
    traces = showcase(args)
    rows = [summary(t) for t in traces]
    plot(traces, args.png)
    if args.json:
        print(json.dumps({"rows": rows, "wall_s": round(time.monotonic() - started, 1), "png": str(args.png)},
                         indent=1))
        return
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    print(f"wall {time.monotonic() - started:.0f} s; plot: {args.png}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
