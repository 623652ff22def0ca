"""Fair Cast in a real RL loop: TRL's `AsyncGRPOTrainer` trains a tiny causal LM (built here, nothing from
a hub) to emit even token ids, with rollouts from a real `vllm serve` that loads each version through
weightsvc's backend (`WeightsvcTransfer`), once per rounding mode and seed; it prints, over the seeds,
the mean and spread of the steps to a reward threshold and of the service's served lag, and the
learner-vs-engine k3 with the learner on its served copy (as trained) and, as diagnostics, on its fp32
masters and on a round-to-nearest copy of them, as a table (`--json`: JSON) and a PNG.

    .venv/bin/python examples/grpo_showcase.py --steps 60 --seeds 0,1,2 --ablate-every 2 --png showcase.png

`--publish`: the learner publishes the served copy it computes instead of pushing its fp32 masters (a
service per rounding mode, each started with --nixl and that rounding; `WeightsvcTransfer(publish=True)`);
the learner measures each version's lag on its masters and sends it with the publish.

The trainer runs here (the `trl` extra); `vllm serve` runs in the engines venv (scripts/setup_engines.sh,
or --engine-python). `train` runs one mode against a service and an engine that are already up (the
engine tests use it; `--trainer grpo` runs TRL's `GRPOTrainer` with `FairCastGRPOTrainer` instead,
against an engine that `weightsvc follow` keeps on the latest version). Without CUDA the trainer's two
GPU-only parts are stood in for (examples/async_grpo_cpu.py).

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
          seed: int = 0, ablate_every: int = 1, max_staleness: int = 0, capture: Path | None = None,
          publish: bool = False) -> dict[str, Any]:
    """One AsyncGRPO run of `steps` optimizer steps; its trace (per step: reward, staleness, mismatch by
    version; per version: the service's lag). `capture`: a directory where each step's first loss forward
    leaves the weights it read (`forward-STEP.safetensors`) and the masters (`masters-STEP.safetensors`).
    `publish`: publish the served copy instead of pushing the masters, to a service started with --nixl
    and `rounding`, in its default format and seed (`served_spec`)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # AsyncGRPOTrainer is experimental in TRL
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from weightsvc.integrations.trl import WeightsvcTransfer

    cpu = not torch.cuda.is_available()
    if cpu:
        from async_grpo_cpu import use_sdpa_tree_attention, without_mfu

        without_mfu()
        # One intra-op thread: the engine and the rollouts share the cores, and torch's threads waiting
        # on one another for a core made the tiny model's forward 17x slower on a busy 2-core machine.
        torch.set_num_threads(1)
    out = tempfile.TemporaryDirectory(prefix="grpo-")
    args = AsyncGRPOConfig(output_dir=out.name, max_steps=steps, learning_rate=lr, per_device_train_batch_size=16,
                           num_generations=8, max_completion_length=COMPLETION_LEN, temperature=1.0,
                           max_staleness=max_staleness, queue_maxsize=32, token_budget=0,
                           vllm_server_base_url=engine, logging_steps=1,
                           report_to="none", save_strategy="no", use_cpu=cpu, bf16=False, seed=seed,
                           gradient_checkpointing=False, disable_tqdm=True, lr_scheduler_type="constant",
                           warmup_steps=0)
    prompts = Dataset.from_dict({"prompt": prompt_texts(seed)})
    transfer = WeightsvcTransfer(target=target, engine=engine, model=model, ablate_every=ablate_every,
                                 **served_spec(rounding, publish))
    trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=even_tokens, args=args, train_dataset=prompts,
                               weight_transfer=transfer,
                               rollout_worker=transfer.rollouts(prompts, even_tokens,
                                                                sampling_params={"ignore_eos": True}))
    if cpu:
        use_sdpa_tree_attention(trainer.model)
    transfer.attach(trainer)
    if capture is not None:
        capture_forwards(trainer, capture)
    started = time.monotonic()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # (the trainer prints its summary: stdout is the table's)
            trainer.train()
    finally:
        transfer.sync.close()
        out.cleanup()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "trainer": "async", "rounding": rounding, "seed": seed, "steps": steps, "served_from": transfer.served_from,
        "publish": publish,
        "seconds": round(time.monotonic() - started, 1), "reward": [h["reward"] for h in logged],
        "staleness_max": [h.get("sample/staleness_max") for h in logged],
        "trained_tokens": [h.get("batch/trained_tokens_per_step") for h in logged],
        "lag": {v: m.lag_steps for v, m in sorted(transfer.lag.items())},
        "model_versions": transfer.pushed,
        "mismatch": [{"step": step, "by_version": {v: asdict(m) for v, m in by.items()}}
                     for step, by in transfer.mismatch],
        "service_mismatch": service_mismatch(target, model),
        "ablation": [{"step": step, "version": version, "by_copy": {c: asdict(m) for c, m in by.items()}}
                     for step, version, by in transfer.ablation],
    }


def served_spec(rounding: str, publish: bool) -> dict[str, Any]:
    """How the learner asks for `rounding`: a push overrides the service's rounding for its model; a publish
    exports with the service's own spec, `serve --nixl --rounding ROUNDING` with its default format and seed."""
    from weightsvc.rounding import ExportSpec

    if publish:
        return {"publish": True, "spec": ExportSpec("bf16", rounding, seed=0)}
    return {"rounding": rounding}


def prompt_texts(seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(["t1", *(f"t{int(t)}" for t in torch.randint(3, VOCAB, (PROMPT_LEN - 1,), generator=g))])
            for _ in range(512)]


def capture_forwards(trainer: Any, where: Path) -> None:
    """Save, at each step's first loss forward, the weights as the model reads them (with the served copy
    standing in: its values) and the fp32 masters under them."""
    import functools

    from safetensors.torch import save_file
    from torch.nn.utils import parametrize

    where.mkdir(parents=True, exist_ok=True)
    model, names, done = trainer.model, [n for n, _ in trainer.model.named_parameters()], set()

    def before(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        step = trainer.state.global_step
        if not kwargs.get("fused_lm_head") or not torch.is_grad_enabled() or step in done:
            return
        done.add(step)
        read, masters = {}, {}
        with torch.no_grad():
            for n in names:
                owner, attr = functools.reduce(getattr, n.split(".")[:-1], module), n.rsplit(".", 1)[-1]
                read[n] = getattr(owner, attr).detach().clone()  # (what the forward reads: the served copy)
                master = (owner.parametrizations[attr].original if parametrize.is_parametrized(owner, attr)
                          else getattr(owner, attr))
                masters[n] = master.detach().clone()
        save_file(read, str(where / f"forward-{step}.safetensors"))
        save_file(masters, str(where / f"masters-{step}.safetensors"))

    model.register_forward_pre_hook(before, with_kwargs=True)


def train_grpo(model_dir: Path, target: str, engine: str, model: str, rounding: str, steps: int, lr: float = LR,
               seed: int = 0, ablate_every: int = 1, publish: bool = False) -> dict[str, Any]:
    """One GRPOTrainer run of `steps` optimizer steps (`FairCastGRPOTrainer`, against an engine that
    `weightsvc follow` keeps on the latest version); its trace (per step: reward, lag, mismatch by version)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from weightsvc.integrations.trl import FairCastGRPOTrainer, WeightsvcSync

    prompts = prompt_texts(seed)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # bf16-exact fp32 masters
    out = tempfile.TemporaryDirectory(prefix="grpo-")
    args = GRPOConfig(output_dir=out.name, max_steps=steps, learning_rate=lr,
                      per_device_train_batch_size=16, num_generations=8, max_completion_length=COMPLETION_LEN,
                      generation_kwargs={"ignore_eos": True}, beta=0.0, temperature=1.0, logging_steps=1,
                      report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=seed,
                      disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0)
    sync = WeightsvcSync(target=target, engine=engine, model=model, ablate_every=ablate_every,
                         **served_spec(rounding, publish))
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
        "trainer": "grpo", "rounding": rounding, "seed": seed, "steps": steps, "served_from": sync.served_from,
        "publish": publish,
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
    """One run: the served lag, the reward curve, the mismatch (the trained tokens, on the served copy)
    and the ablation's k3 on each of the learner's copies."""
    rewards, lag = trace["reward"], [v for k, v in trace["lag"].items() if int(k) > 0]
    window = [sum(rewards[max(0, i - 4): i + 1]) / len(rewards[max(0, i - 4): i + 1]) for i in range(len(rewards))]
    diffs = [m for b in trace["mismatch"] for m in b["by_version"].values()]
    return {
        "rounding": trace["rounding"], "seed": trace["seed"],
        # (None: no lag figures)
        "lag_mean": sum(lag) / len(lag) if lag else None, "lag_max": max(lag) if lag else None,
        "steps_to": next((i + 1 for i, r in enumerate(window) if r >= THRESHOLD), None),
        "reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
        "k3_trained": weighted(diffs, "k3_kl"),
        # (version 0 is the bf16 checkpoint itself, which every rounding serves as it is)
        **{f"k3 {copy}": weighted([b["by_copy"][copy] for b in trace["ablation"] if b.get("version", b["step"]) >= 1],
                                  "k3_kl") for copy in COPIES},
        "versions_per_step": sum(len(b["by_version"]) for b in trace["mismatch"]) / max(1, len(trace["mismatch"])),
        "seconds": trace["seconds"],
    }


COPIES = ("served", "masters", "rtn copy")


def weighted(ms: list[dict[str, Any]], key: str) -> float | None:
    """The token-weighted mean of `key` over mismatch records (None without a token)."""
    tokens = sum(m["tokens"] for m in ms)
    return sum(m[key] * m["tokens"] for m in ms) / tokens if tokens else None


def over_seeds(rows: list[dict[str, Any]], steps: int) -> list[dict[str, str]]:
    """Per rounding mode: mean ± sample standard deviation over the seeds (steps to the threshold over
    the runs that reached it, with how many did)."""
    import statistics

    def spread(values: list[float], fmt: str) -> str:
        if not values:
            return "-"
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{format(statistics.fmean(values), fmt)} ± {format(sd, fmt)}"

    table = []
    for mode in dict.fromkeys(r["rounding"] for r in rows):
        runs = [r for r in rows if r["rounding"] == mode]
        reached = [r["steps_to"] for r in runs if r["steps_to"] is not None]
        table.append({
            "rounding": mode, "seeds": str(len(runs)),
            f"steps_to_{THRESHOLD}": f"{spread(reached, '.1f')} ({len(reached)}/{len(runs)} within {steps})",
            "lag_mean": spread([r["lag_mean"] for r in runs if r["lag_mean"] is not None], ".2f"),
            "lag_max": spread([r["lag_max"] for r in runs if r["lag_max"] is not None], ".1f"),
            "reward_last5": spread([r["reward_last5"] for r in runs], ".3f"),
            **{f"k3 {c}": spread([r[f"k3 {c}"] for r in runs if r[f"k3 {c}"] is not None], ".2e") for c in COPIES},
            "versions_per_step": spread([r["versions_per_step"] for r in runs], ".2f"),
        })
    return table


def plot(traces: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_lag, ax_reward, ax_mis) = plt.subplots(1, 3, figsize=(15, 4))
    colors = {mode: f"C{i}" for i, mode in enumerate(dict.fromkeys(t["rounding"] for t in traces))}
    for t in traces:
        lag = {int(k): v for k, v in t["lag"].items()}
        style = {"color": colors[t["rounding"]], "alpha": 0.7, "label": f"{t['rounding']} seed {t['seed']}"}
        ax_lag.plot(sorted(lag), [lag[k] for k in sorted(lag)], **style)
        ax_reward.plot(range(1, len(t["reward"]) + 1), t["reward"], **style)
        ax_mis.plot([b["step"] for b in t["ablation"]], [b["by_copy"]["served"]["k3_kl"] for b in t["ablation"]],
                    **style)
    ax_lag.set(title="served lag (service's metric)", xlabel="version (step)", ylabel="lag (steps)")
    ax_reward.axhline(THRESHOLD, color="grey", lw=0.5)
    ax_reward.set(title="AsyncGRPO reward (rollouts from vllm serve)", xlabel="step", ylabel="share of even tokens")
    ax_mis.set(title="learner (served copy) vs engine, k3", xlabel="step", ylabel="k3", yscale="log")
    ax_lag.legend(fontsize=7)
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
    """Every mode and seed against one service and one engine: each run's first version (its bf16
    checkpoint, built with its seed) replaces what the engine held. With --publish, one service per mode
    (--nixl, and the mode as its rounding: a published copy is in the service's own export)."""
    from weightsvc.server.server import BackgroundServer
    from weightsvc.settings import Settings

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="grpo-showcase-"))
    print(f"logs, models: {work}", file=sys.stderr)
    seeds = [int(s) for s in args.seeds.split(",")]
    models = {seed: build(work / f"model-{seed}", seed) for seed in seeds}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    vllm = [engine_python(args.engine_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(models[seeds[0]]), "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16",
            "--max-model-len", "64", "--enforce-eager", "--seed", "0", "--enable-scale-out", "--logprobs-mode",
            "processed_logprobs", "--weight-transfer-config", '{"backend": "weightsvc"}']
    traces, modes = [], args.modes.split(",")
    with contextlib.ExitStack() as up:
        ports = {"grpc_port": 0, "http_port": 0, "probe_port": 0}
        if args.publish:
            targets = {mode: up.enter_context(BackgroundServer(Settings(**ports, nixl=True, rounding=mode))).grpc_target
                       for mode in modes}
        else:
            target = up.enter_context(BackgroundServer(Settings(**ports))).grpc_target
            targets = dict.fromkeys(modes, target)
        engine = up.enter_context(process(vllm, work / "vllm.log",
                                          {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}))
        _wait_http(f"{url}/health", engine, work / "vllm.log")
        for seed in seeds:
            for mode in modes:
                traces.append(train(models[seed], targets[mode], url, f"showcase-{mode}-{seed}", mode, args.steps,
                                    args.lr, seed, args.ablate_every, args.max_staleness, publish=args.publish))
                print(f"{mode} seed {seed}: {json.dumps(summary(traces[-1]))}", file=sys.stderr)
                (work / "traces.json").write_text(json.dumps(traces))
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
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--trainer", choices=("async", "grpo"), default="async")
    one.add_argument("--capture", type=Path, default=None,
                     help="async: save each step's loss-forward weights and masters here")
    make = sub.add_parser("build", help="build the tiny model into --model-dir")
    make.add_argument("--model-dir", type=Path, required=True)
    make.add_argument("--seed", type=int, default=0)
    for p in (parser, one):
        p.add_argument("--steps", type=int, default=60)
        p.add_argument("--lr", type=float, default=LR)
        p.add_argument("--ablate-every", type=int, default=1,
                       help="also measure the mismatch on the masters and an rtn copy, every N steps (0: never)")
        p.add_argument("--max-staleness", type=int, default=0, help="async: TRL's max_staleness")
        p.add_argument("--publish", action="store_true",
                       help="publish the served copy (the service runs with --nixl) instead of pushing the masters")
    parser.add_argument("--modes", default="rtn,sr")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--engine-python", default=None, help="python of the engines venv (default: setup_engines.sh)")
    parser.add_argument("--work-dir", type=Path, default=None, help="the models and the logs (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the tables as JSON")
    parser.add_argument("--png", type=Path, default=Path("grpo_showcase.png"))
    args = parser.parse_args()
    if args.command == "build":
        build(args.model_dir, args.seed)
        return
    if args.command == "train":
        if args.trainer == "grpo":
            trace = train_grpo(args.model_dir, args.target, args.engine, args.model, args.rounding, args.steps,
                               args.lr, args.seed, args.ablate_every, args.publish)
        else:
            trace = train(args.model_dir, args.target, args.engine, args.model, args.rounding, args.steps, args.lr,
                          args.seed, args.ablate_every, args.max_staleness, args.capture, args.publish)
        args.out.write_text(json.dumps(trace))
        return
    started = time.monotonic()
    traces = showcase(args)
    rows = [summary(t) for t in traces]
    table = over_seeds(rows, args.steps)
    plot(traces, args.png)
    if args.json:
        print(json.dumps({"table": table, "runs": rows, "wall_s": round(time.monotonic() - started, 1),
                          "png": str(args.png)}, indent=1))
        return
    cols = list(table[0])
    print(" | ".join(cols))
    for r in table:
        print(" | ".join(str(r[c]) for c in cols))
    print(f"wall {time.monotonic() - started:.0f} s; plot: {args.png}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
