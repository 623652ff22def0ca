"""The worker side of vLLM: `pull_for_rank` (what one tensor-parallel rank pulls of a version, checked
against its engine and made ready for vLLM's loaders), and `VllmWorkerExtension`, mixed into each
worker of an `LLM`, which pulls and loads it. vLLM itself is imported only in the worker, to ask it
the rank and to reload."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from weightsvc.client import InferenceClient, Slice, dequantize
from weightsvc.client._tensors import TORCH_DTYPES
from weightsvc.integrations.vllm.checkpoint import calibration, check_engine_fits, served_masters
from weightsvc.integrations.vllm.layout import placed, tp_select
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.selection import sliced_shape

__all__ = ["VllmWorkerExtension", "pull_for_rank", "reload_in_place", "staging", "tp_rank"]


def pull_for_rank(client: InferenceClient, model: str, version: int, config: Any, rank: int, size: int,
                  dequantize_fp8: bool = False, transport: str = "tcp"
                  ) -> tuple[Manifest, dict[str, torch.Tensor], int]:
    """What tensor-parallel rank `rank` of `size` loads of a version: its manifest, the weights by the
    names vLLM's `load_weights` takes (verified; each slice at its place in its whole tensor; tied and
    calibration names filled), and the bytes pulled. The version is checked against the engine's
    checkpoint (`config`: its `ModelConfig`) before a byte is pulled: a `Mismatch` writes nothing.

    With `transport` "nixl", the rank's slices are READ over NIXL into staging tensors allocated here
    (host memory), or pulled over TCP into them when NIXL cannot reach the server (one line says so)."""
    hf = config.hf_config
    manifest = client.manifest(model, version)
    check_engine_fits(manifest, config, dequantize=dequantize_fp8)
    heads = getattr(hf, "num_attention_heads", 1) or 1
    head_dim = getattr(hf, "head_dim", None) or getattr(hf, "hidden_size", 0) // heads
    select = tp_select(manifest, rank, size, num_kv_heads=getattr(hf, "num_key_value_heads", None),
                       head_dim=head_dim)
    if dequantize_fp8:  # a scaled master is dequantized whole (an fp8 block spans several ranks' rows)
        select.update({n: None for _, parts in served_masters(manifest).values() if len(parts) > 1
                       for n in parts})
    sliced = {n: s for n, s in select.items() if s is not None}
    if transport == "nixl":
        weights = staging(manifest, select)
        client.pull_into(weights, model, manifest.version, select=select if sliced else None)
        pulled = sum(t.numel() * t.element_size() for t in weights.values())
    else:
        weights = client.pull(model, manifest.version, select=select if sliced else None)
        pulled = client.last_pull_bytes
    if dequantize_fp8:
        weights = {n: t.to(config.dtype) for n, t in dequantize(weights).items()}
    shapes = {t.name: t.shape for t in manifest.tensors}
    for name, part in sliced.items():
        weights[name] = placed(weights[name], shapes[name], part)
    weights = manifest.with_aliases(weights)
    if getattr(hf, "tie_word_embeddings", False) and "lm_head.weight" not in weights:
        # vLLM's in-place reload keeps the head it had unless it is given one (the version's
        # checkpoint omits the tied name): hand it the embeddings under the head's name.
        embed = next((n for n in weights if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            weights["lm_head.weight"] = weights[embed]
    # vLLM's in-place reload rebuilds a layer from what it is given: the checkpoint's calibration too.
    weights.update({n: t for n, t in calibration(str(config.model)).items() if n not in weights})
    return manifest, weights, pulled


def staging(manifest: Manifest, select: Mapping[str, Slice | None]) -> dict[str, torch.Tensor]:
    """Empty tensors of the served dtype and (sliced) shape of each selected tensor, to READ into."""
    by_name = {t.name: t for t in manifest.tensors}
    return {name: torch.empty(sliced_shape(by_name[name].shape, cut), dtype=TORCH_DTYPES[by_name[name].dtype])
            for name, cut in select.items()}


def reload_in_place(model: Any, model_config: Any, weights: dict[str, torch.Tensor]) -> None:
    """vLLM's layerwise reload of checkpoint-format weights: each layer is restored to its checkpoint
    layout, loaded, and processed again for its kernels."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    model.load_weights(weights=iter(weights.items()))
    finalize_layerwise_reload(model, model_config)


def tp_rank() -> tuple[int, int]:
    """This worker's tensor-parallel rank and size."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _true(value: bool | str) -> bool:
    return value is True or str(value).lower() in ("true", "1")


class VllmWorkerExtension:
    """Mixed into each vLLM worker by `LLM(..., worker_extension_cls="weightsvc.loaders.VllmWorkerExtension")`
    (or `vllm serve ... --worker-extension-cls ...`).

    Each worker checks the version against the checkpoint its engine was started from, pulls what
    its tensor-parallel rank needs (all of it with TP 1), verifies it, and only then reloads: through
    the worker's `reload_weights` where vLLM has it (it restores the layers' checkpoint layout,
    loads, and repacks them for its kernels), else through the model's `load_weights`. Called through
    `collective_rpc` (`update_vllm`, or the HTTP server's `/collective_rpc`, whose arguments are
    strings: the version and the flag are read from them too)."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def weightsvc_load(self, target: str, model: str, version: int | str,
                       dequantize_fp8: bool | str = False) -> dict[str, int]:
        rank, size = self._weightsvc_tp()
        with InferenceClient(target) as client:
            _, weights, pulled = pull_for_rank(client, model, int(version), self.model_runner.model_config, rank,
                                               size, _true(dequantize_fp8))
        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            reload(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        else:  # vLLM before in-place reload: its layers still hold the checkpoint layout on GPUs
            self.model_runner.model.load_weights(weights=iter(weights.items()))
        return {"rank": rank, "pulled_bytes": pulled}

    def weightsvc_alive(self) -> bool:
        return True

    def _weightsvc_tp(self) -> tuple[int, int]:
        return tp_rank()
