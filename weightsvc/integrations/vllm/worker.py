"""The worker side of vLLM: `VllmWorkerExtension`, mixed into each worker of an `LLM`, pulls and
loads what its tensor-parallel rank needs. vLLM itself is imported only in the worker, to ask it
the rank."""

from __future__ import annotations

from typing import Any

from weightsvc.client import InferenceClient, dequantize
from weightsvc.integrations.vllm.checkpoint import calibration, check_engine_fits, served_masters
from weightsvc.integrations.vllm.layout import placed, tp_select

__all__ = ["VllmWorkerExtension"]


class VllmWorkerExtension:
    """Mixed into each vLLM worker by `LLM(..., worker_extension_cls="weightsvc.loaders.VllmWorkerExtension")`.

    Each worker checks the version against the checkpoint its engine was started from, pulls what
    its tensor-parallel rank needs (all of it with TP 1), verifies it, and only then reloads: through
    the worker's `reload_weights` where vLLM has it (it restores the layers' checkpoint layout,
    loads, and repacks them for its kernels), else through the model's `load_weights`. Called through
    `collective_rpc`; see `update_vllm`."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def weightsvc_load(self, target: str, model: str, version: int, dequantize_fp8: bool = False) -> dict[str, int]:
        rank, size = self._weightsvc_tp()
        config = self.model_runner.model_config
        hf = config.hf_config
        with InferenceClient(target) as client:
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
            weights = client.pull(model, version, select=select) if sliced else client.pull(model, version)
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
        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            reload(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        else:  # vLLM before in-place reload: its layers still hold the checkpoint layout on GPUs
            self.model_runner.model.load_weights(weights=iter(weights.items()))
        return {"rank": rank, "pulled_bytes": pulled}

    def weightsvc_alive(self) -> bool:
        return True

    def _weightsvc_tp(self) -> tuple[int, int]:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
