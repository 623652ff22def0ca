"""Tiny real models for the engine tests: built from a config with random weights and a tokenizer
made here (nothing from a hub), saved as an engine loads them, and a vLLM engine started on them."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from weightsvc import InferenceClient, rounding
from weightsvc.loaders import compressed_tensors_config

VOCAB = 512
PROMPTS = [[1, 5, 9, 33, 70], [1, 100, 7], [1, 300, 301, 302, 450, 12, 77]]
# vLLM's CPU attention kernels take head sizes of 32 and up.
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
             initializer_range=0.2)


def masters(kind: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny decoder (`llama`: head untied; `qwen2`: head tied to the embeddings) and its fp32 state dict."""
    torch.manual_seed(seed)
    if kind == "llama":
        module: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False))
    else:
        module = Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))
    return module, module.state_dict()


def step(module: torch.nn.Module, seed: int, size: float = 0.05) -> dict[str, torch.Tensor]:
    """A learner step big enough to change greedy generations; returns the new state dict (tied
    parameters stay tied: `parameters()` holds each once)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(size * torch.randn(p.shape, generator=gen))
    return module.state_dict()


def save_tokenizer(path: Path) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0",
                            pad_token="t0").save_pretrained(path)


def checkpoint(module: torch.nn.Module, path: Path) -> Path:
    """The engine's starting checkpoint: the module in bf16, as `save_pretrained` writes it."""
    copy.deepcopy(module).to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(path)
    return path


# The tensors a microscaled engine runs quantized: its linear layers. The head stays bf16 (vLLM's
# output head takes no scales; it is in the config's `ignore`), as do embeddings and norms.
LINEARS = r"^(?!.*(?:embed|norm|lm_head)).*\.weight$"


# NVFP4 (W4A4) activation calibration: compressed-tensors' 2688 / amax(inputs), here 1. vLLM quantizes a
# layer's input in blocks of 16 with the e4m3 scale gs * amax(block) / 6: with gs = 1 every block whose
# max is above 6 * 2**-6 (0.094) gets a normal e4m3 scale, and the inputs here are RMS-normalized (of
# order 1). A deployment keeps what its calibration gave; weightsvc never changes it.
INPUT_GLOBAL_SCALE = torch.ones(1)


def quantized_checkpoint(module: torch.nn.Module, path: Path, format: str) -> Path:
    """The engine's starting checkpoint in a microscaled `format`: the module's served copy rounded
    to nearest, with the compressed-tensors `quantization_config` vLLM reads it by (and, for NVFP4,
    the activation calibration in a file of its own)."""
    checkpoint(module, path)
    spec = rounding.ExportSpec(format, "rtn", fp8_pattern=LINEARS)
    served = rounding.export_state_dict(dict(module.state_dict()), spec, version=0)
    save_file({n: t.contiguous() for n, t in served.items()}, str(path / "model.safetensors"))
    if format == "nvfp4":  # its W4A4 scheme quantizes each linear layer's input under a calibrated scale
        calibration = {n.removesuffix("weight_global_scale") + "input_global_scale": INPUT_GLOBAL_SCALE.clone()
                       for n in served if n.endswith(".weight_global_scale")}
        save_file(calibration, str(path / "calibration.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = compressed_tensors_config(format)
    (path / "config.json").write_text(json.dumps(config))
    return path


def served_checkpoint(start: Path, target: str, model: str, version: int, path: Path,
                      quantization: dict[str, Any] | None = None) -> Path:
    """A checkpoint made of a pulled served copy: the config, tokenizer and activation calibration of
    `start`, and the version's safetensors file as the weights."""
    path.mkdir(parents=True)
    for f in start.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, path / f.name)
    if quantization is not None:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = quantization
        (path / "config.json").write_text(json.dumps(config))
    with InferenceClient(target) as client:
        client.pull_file(path / "model.safetensors", model, version)
    return path


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """`values` set in the environment for the block; what was there before, after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spare_llvmlite_from_vllms_kernel_scan() -> None:
    """A worker starting in this process has vLLM's CPU platform rebind its Triton kernels: it reads
    `vars(value)` of every object with a `__dict__` in every loaded module
    (`vllm.triton_utils.dispatcher._rebind_kernels`). llvmlite's `ffi.lib`, loaded here by weightsvc's
    numba kernels (the in-process service exports with them), answers any attribute, `__dict__` too,
    with a wrapped C function, and the scan fails on it (AttributeError: '_lib_fn_wrapper' object has
    no attribute 'get'). An empty `__dict__` of its own gives the scan nothing to rebind there."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None:
        ffi.lib._fntab.setdefault("__dict__", {})


# The engines of this process whose worker runs in it: vLLM keeps a worker's parallel groups in globals
# (one such engine at a time) and mixes the first worker extension into its worker class for good.
_workers_here: dict[str, Any] = {"alive": 0, "extension": None}


@contextlib.contextmanager
def engine(path: Path, tp: int = 1, in_process: bool = True, **kwargs: Any) -> Iterator[Any]:
    """A vLLM engine on the CPU with weightsvc's worker extension, shut down on exit.

    `in_process`: the engine core runs in this process (a start takes seconds, not the half minute of
    spawning a process that loads vLLM again), unless its worker (tp=1) would live beside another one
    here or with another extension than the earlier ones; an engine whose worker is meant to die, or
    one that stays up while others start (a class's engine), asks for a process of its own."""
    import vllm.envs
    from vllm import LLM

    kwargs.setdefault("worker_extension_cls", "weightsvc.loaders.VllmWorkerExtension")
    extension = kwargs["worker_extension_cls"]
    worker_here = in_process and tp == 1
    if worker_here and (_workers_here["alive"] or _workers_here["extension"] not in (None, extension)):
        in_process = worker_here = False
    if in_process:
        _spare_llvmlite_from_vllms_kernel_scan()
    with _environ(VLLM_ENABLE_V1_MULTIPROCESSING="0" if in_process else "1"):
        vllm.envs.disable_envs_cache()  # an engine core in this process fixed vLLM's settings: read them again
        llm = LLM(model=str(path), dtype="bfloat16", max_model_len=64, enforce_eager=True, seed=0,
                  tensor_parallel_size=tp, **kwargs)
    if worker_here:
        _workers_here.update(alive=1, extension=extension)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):  # (an engine that died is gone already)
            llm.llm_engine.engine_core.shutdown()
        del llm
        if worker_here:
            _workers_here["alive"] = 0
        gc.unfreeze()  # an engine core started here froze the heap it found: let it be collected again
        gc.collect()


def generate(llm: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy generations of the fixed prompts: tokens, and the log-probability of each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
            for c in (o.outputs[0] for o in out)]
