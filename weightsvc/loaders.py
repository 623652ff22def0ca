"""Load served copies into running inference engines: vLLM, SGLang, and any torch module.

Each `update_*` helper resolves the version once (so that every worker of a tensor-parallel engine
loads the same one), loads it without restarting the engine, and acks it, so that the service's
staleness metrics see the fleet move. They take the engine object; weightsvc imports neither vLLM
nor SGLang.

vLLM (`LLM` or `AsyncLLMEngine`-backed `LLM` with any tensor-parallel size):

    llm = LLM(model=..., worker_extension_cls="weightsvc.loaders.VllmWorkerExtension")
    update_vllm(llm, "weightsvc:50051", "policy")          # each worker pulls and load_weights()

SGLang (`sglang.Engine`):

    update_sglang(engine, "weightsvc:50051", "policy")

HF transformers or plain torch (`load_state_dict` semantics, in place, dtype cast per parameter):

    update_module(model, "weightsvc:50051", "policy")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsvc.client import InferenceClient, dequantized

__all__ = ["VllmWorkerExtension", "dequantize", "load_into", "update_module", "update_sglang", "update_vllm"]

SCALE_SUFFIX = "_scale_inv"


def dequantize(served: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The served tensors as values a module can load: fp8 tensors times their scales (fp32), the
    `<name>_scale_inv` tensors dropped, everything else as served."""
    return {
        name: dequantized(served, name) if name + SCALE_SUFFIX in served else t
        for name, t in served.items()
        if not (name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in served)
    }


def load_into(module: torch.nn.Module, served: Mapping[str, torch.Tensor], *, strict: bool = True) -> Any:
    """Copy a served copy into `module` in place with `load_state_dict`: each value is cast to its
    parameter's dtype and device. With `strict`, the names must match the module's state dict
    exactly; without, the result lists the missing and unexpected keys."""
    with torch.no_grad():
        return module.load_state_dict(dequantize(served), strict=strict)


def _update(
    target: str, model: str, version: int | str, client_id: str | None, load: Callable[[InferenceClient, int], None]
) -> int:
    """Resolve `version` once, `load(client, number)` it, ack it; returns the version number."""
    with InferenceClient(target) as client:
        number = client.manifest(model, version).version
        load(client, number)
        client.ack(model, number, client_id)
    return number


def update_module(
    module: torch.nn.Module,
    target: str,
    model: str = "default",
    version: int | str = "latest",
    *,
    client_id: str | None = None,
    strict: bool = True,
) -> int:
    """Pull a version into a torch module (an HF transformers model included) and ack it; returns it."""
    return _update(target, model, version, client_id,
                   lambda client, number: load_into(module, client.pull(model, number), strict=strict))  # fmt: skip


def update_sglang(
    engine: Any,
    target: str,
    model: str = "default",
    version: int | str = "latest",
    *,
    client_id: str | None = None,
    flush_cache: bool = True,
) -> int:
    """Pull a version into a running `sglang.Engine` with `update_weights_from_tensor` and ack it.

    SGLang's model loaders take checkpoint names and shapes, as the learner pushed them, and fp8
    tensors with their `<name>_scale_inv` scales. The prefix cache is flushed: KV entries computed
    with the old weights are stale."""

    def load(client: InferenceClient, number: int) -> None:
        weights = client.pull(model, number)
        engine.update_weights_from_tensor(named_tensors=list(weights.items()), flush_cache=flush_cache)

    return _update(target, model, version, client_id, load)


class VllmWorkerExtension:
    """Mixed into each vLLM worker by `LLM(..., worker_extension_cls="weightsvc.loaders.VllmWorkerExtension")`.

    Every worker (one per GPU) pulls the version itself and hands the checkpoint-named tensors to
    the model's `load_weights`, which fuses (qkv, gate_up) and slices them for its tensor-parallel
    rank as it does at start-up. Called through `collective_rpc`; see `update_vllm`."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def weightsvc_load(self, target: str, model: str, version: int) -> int:
        with InferenceClient(target) as client:
            loaded = self.model_runner.model.load_weights(weights=client.iter_weights(model, version))
        return len(loaded) if loaded is not None else 0


def update_vllm(
    llm: Any,
    target: str,
    model: str = "default",
    version: int | str = "latest",
    *,
    client_id: str | None = None,
) -> int:
    """Load a version into every worker of a vLLM `LLM` and ack it; returns the version.

    The version is resolved here, once, so that all tensor-parallel workers load the same one even
    if a new version commits meanwhile. The prefix cache is reset afterwards (its KV entries were
    computed with the old weights)."""

    def load(_client: InferenceClient, number: int) -> None:
        llm.collective_rpc("weightsvc_load", args=(target, model, number))  # each worker pulls it
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()

    return _update(target, model, version, client_id, load)
