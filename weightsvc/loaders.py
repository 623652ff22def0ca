"""Load served copies into running inference engines: vLLM, SGLang, and any torch module.

Each `update_*` helper resolves the version once (so that every worker of a tensor-parallel engine
loads the same one), checks that it fits the engine before anything is written into it, loads it
without restarting the engine, and acks it only once the engine runs it, so that the service's
staleness metrics see the fleet move. A version that does not fit is refused, naming the first
tensor that does not, and the engine keeps the version it had. weightsvc imports neither vLLM nor
SGLang.

vLLM (`LLM` with any tensor-parallel size; each worker pulls its own slice):

    llm = LLM(model=..., worker_extension_cls="weightsvc.loaders.VllmWorkerExtension")
    update_vllm(llm, "weightsvc:50051", "policy")

An engine started from a checkpoint in a served microscaled format (`compressed_tensors_config`)
loads its versions as they are; on vLLM's CPU backend use
`worker_extension_cls="weightsvc.loaders.VllmCpuEmulationExtension"`, which gives the CPU vLLM's own
emulation kernels for MXFP8 and NVFP4 (that one class imports vLLM, in the worker).

SGLang (`sglang.Engine`):

    update_sglang(engine, "weightsvc:50051", "policy")

HF transformers or plain torch (in place, each value cast to its parameter's dtype):

    update_module(model, "weightsvc:50051", "policy")

A LoRA adapter's version goes into a PEFT `PeftModel` the same way (PEFT's hot-swap of the adapter's
weights); `weightsvc.integrations.peft` has the learner's side (`adapter_state`, `served_adapter`).

Tied weights (an output head tied to the embeddings) are served once under both names; every
loader fills the names the engine keeps and accepts a version that omits the tied name.

This module is the public face of `weightsvc.integrations`, which holds each host's code.
"""

from __future__ import annotations

from weightsvc.integrations._common import Mismatch
from weightsvc.integrations.sglang import update_sglang
from weightsvc.integrations.torch import LoadResult, dequantize, load_into, update_module
from weightsvc.integrations.vllm.checkpoint import (
    CALIBRATION,
    CODE_DTYPES,
    FP8_DTYPES,
    check_engine_fits,
    check_fits,
    compressed_tensors_config,
)
from weightsvc.integrations.vllm.engine import ALIVE_TIMEOUT_S, update_vllm
from weightsvc.integrations.vllm.layout import (
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    VOCAB_PADDING,
    VOCAB_PARALLEL,
    WEIGHT_PARTS,
    tp_select,
)
from weightsvc.integrations.vllm.revisions import LlmAdapters
from weightsvc.integrations.vllm.worker import VllmWorkerExtension

__all__ = [
    "ALIVE_TIMEOUT_S",
    "CALIBRATION",
    "CODE_DTYPES",
    "COLUMN_PARALLEL",
    "FP8_DTYPES",
    "ROW_PARALLEL",
    "VOCAB_PADDING",
    "VOCAB_PARALLEL",
    "WEIGHT_PARTS",
    "LlmAdapters",
    "LoadResult",
    "Mismatch",
    "VllmWorkerExtension",
    "check_engine_fits",
    "check_fits",
    "compressed_tensors_config",
    "dequantize",
    "load_into",
    "tp_select",
    "update_module",
    "update_sglang",
    "update_vllm",
]


def __getattr__(name: str) -> type[VllmWorkerExtension]:
    # `weightsvc.loaders.VllmCpuEmulationExtension` (a `worker_extension_cls`) is resolved only in vLLM's
    # workers: its module imports vLLM, which weightsvc itself never does.
    if name == "VllmCpuEmulationExtension":
        from weightsvc.integrations.vllm.cpu import VllmCpuEmulationExtension

        return VllmCpuEmulationExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
