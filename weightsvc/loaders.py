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

Tied weights (an output head tied to the embeddings) are served once under both names; every
loader fills the names the engine keeps and accepts a version that omits the tied name.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from weightsvc.client import InferenceClient, Slice, dequantize
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.safetensors import header_length, read_safetensors_header

__all__ = [
    "Mismatch",
    "VllmWorkerExtension",
    "compressed_tensors_config",
    "dequantize",
    "load_into",
    "tp_select",
    "update_module",
    "update_sglang",
    "update_vllm",
]

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
# Codes and block scales are loaded bit for bit: served and engine dtypes must be the same. Any other
# dtype is values, which an engine casts to its own precision.
CODE_DTYPES = (*FP8_DTYPES, "U8")
# Activation calibration of a checkpoint (NVFP4 W4A4's per-layer input scale): not trained, so never
# in a version; the engine keeps its checkpoint's (`VllmWorkerExtension` reloads them with each version).
CALIBRATION = (".input_global_scale",)
ALIVE_TIMEOUT_S = 10.0  # for the workers of a live engine to answer after a failed update


class Mismatch(ValueError):
    """A version that does not fit the engine it was to be loaded into; nothing was written."""


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _memory(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride()


def load_into(module: torch.nn.Module, served: Mapping[str, torch.Tensor], *, strict: bool = True) -> LoadResult:
    """Copy a served copy into `module` in place; each value is cast to its entry's dtype and device.

    Everything is checked before anything is copied: a shape that differs raises `Mismatch` naming
    the tensor, and so does, with `strict`, a name the module lacks or a module entry the served
    copy lacks. Entries the module ties (they share memory, as a head tied to the embeddings does)
    need only one of their names. Without `strict`, the result lists missing and unexpected names."""
    values = dequantize(served)
    state = module.state_dict()  # detached views of the parameters and buffers
    by_memory: dict[tuple[Any, ...], list[str]] = {}
    for key, t in state.items():
        by_memory.setdefault(_memory(t), []).append(key)
    source: dict[str, str] = {}  # module entry -> served name
    missing: list[str] = []
    for key, t in state.items():
        name = key if key in values else next((k for k in by_memory[_memory(t)] if k in values), None)
        if name is None:
            missing.append(key)
            continue
        if tuple(values[name].shape) != tuple(t.shape):
            raise Mismatch(f"tensor {name!r} has shape {list(values[name].shape)}; the module expects "
                           f"{list(t.shape)} for {key!r}")
        source[key] = name
    objects = {id(v) for k, v in values.items() if k in state}
    unexpected = [k for k, v in values.items() if k not in state and id(v) not in objects]  # aliases are not
    if strict and (missing or unexpected):
        raise Mismatch(
            "the served copy does not fit the module: "
            + "; ".join(
                [f"missing {k!r} (shape {list(state[k].shape)})" for k in missing[:5]]
                + [f"unexpected {k!r} (shape {list(values[k].shape)})" for k in unexpected[:5]]
            )
        )
    written: set[tuple[Any, ...]] = set()
    with torch.no_grad():
        for key, name in source.items():
            where = _memory(state[key])
            if where not in written:  # tied entries are written once
                state[key].copy_(values[name])
                written.add(where)
    return LoadResult(missing, unexpected)


def _update(target: str, model: str, version: int | str, client_id: str | None,
            load: Callable[[InferenceClient, Manifest], object]) -> int:
    """Resolve `version` once, `load(client, manifest)` it, and ack it once loaded; returns its number."""
    with InferenceClient(target) as client:
        manifest = client.manifest(model, version)
        load(client, manifest)
        client.ack(model, manifest.version, client_id)
    return manifest.version


def update_module(
    module: torch.nn.Module,
    target: str,
    model: str = "default",
    version: int | str = "latest",
    *,
    client_id: str | None = None,
    strict: bool = True,
) -> int:
    """Pull a version into a torch module (an HF transformers model included) and ack it; returns it.
    The whole version is pulled and verified before `load_into` writes any of it."""
    return _update(target, model, version, client_id,
                   lambda client, m: load_into(module, client.pull(model, m.version), strict=strict))


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

    Written against SGLang 0.5.23 (`update_weights_from_tensor(named_tensors, load_format=None,
    flush_cache=True)` -> `(success, message)`), inside the `begin_weight_update()` /
    `end_weight_update()` session that 0.5.21 and later require. Its model loaders take checkpoint
    names and shapes, as the learner pushed them; tied aliases come under both names (its models
    skip the head when the config ties it). The prefix cache is flushed: KV entries computed with
    the old weights are stale. An update the engine reports as failed raises, and is not acked."""

    def load(client: InferenceClient, m: Manifest) -> None:
        weights = client.pull(model, m.version)
        session = hasattr(engine, "begin_weight_update")  # SGLang 0.5.21 and later update in a session
        if session:
            engine.begin_weight_update()
        try:
            result = engine.update_weights_from_tensor(named_tensors=list(weights.items()), flush_cache=flush_cache)
        finally:
            if session:
                engine.end_weight_update()
        if isinstance(result, tuple) and result and result[0] is False:
            why = result[1] if len(result) > 1 else "no reason given"
            raise RuntimeError(f"model {model!r} version {m.version}: SGLang refused the update: {why}")

    return _update(target, model, version, client_id, load)


# ---- vLLM ----------------------------------------------------------------------------------------

# Tensor-parallel layout of vLLM's decoder models (Llama, Qwen2, Mistral and their kin): which
# checkpoint tensors each rank holds rows of (column-parallel, and the vocabulary-parallel
# embeddings and head) or columns of (row-parallel); every other tensor is whole on every rank.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this before splitting it
# A weight's served tensors that are split as it is: its elements (packed two per byte in fp4) and
# its per-row block scales (microscaled formats; `rounding.served_tensors`).
WEIGHT_PARTS = ("weight", "weight_packed", "weight_scale")


def tp_select(manifest: Manifest, rank: int, size: int, *, num_kv_heads: int | None = None,
              head_dim: int | None = None) -> dict[str, Slice | None]:
    """What tensor-parallel rank `rank` of `size` needs of a version: the rows or columns of each
    parallel tensor that vLLM's layers keep on that rank, and the other tensors whole.

    k/v projections with fewer KV heads than ranks are replicated, one head per group of ranks
    (`num_kv_heads` and `head_dim` from the model's config). fp8 scales come whole (a 128 x 128
    block spans the rows of several ranks). The microscaled formats' packed elements and block
    scales (one per row and block of 16 or 32) are split as their weight is, which keeps a rank's
    part on block boundaries wherever vLLM can split the layer at all; NVFP4's global scales come whole."""
    select: dict[str, Slice | None] = {}
    for t in manifest.tensors:
        module, _, param = t.name.rpartition(".")
        layer = module.rpartition(".")[2]
        select[t.name] = None
        if size == 1 or param not in (*WEIGHT_PARTS, "bias") or not t.shape:
            continue
        if layer in VOCAB_PARALLEL and param in WEIGHT_PARTS:
            per_rank = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING // size
            start, stop = rank * per_rank, min((rank + 1) * per_rank, t.shape[0])
            if start < stop:
                select[t.name] = Slice(0, start, stop)
        elif layer in ("k_proj", "v_proj") and num_kv_heads and head_dim and num_kv_heads < size:
            head = rank // (size // num_kv_heads)
            select[t.name] = Slice(0, head * head_dim, (head + 1) * head_dim)
        elif layer in COLUMN_PARALLEL and t.shape[0] % size == 0:
            rows = t.shape[0] // size
            select[t.name] = Slice(0, rank * rows, (rank + 1) * rows)
        elif layer in ROW_PARALLEL and param in WEIGHT_PARTS and len(t.shape) == 2 and t.shape[1] % size == 0:
            cols = t.shape[1] // size
            select[t.name] = Slice(1, rank * cols, (rank + 1) * cols)
    return select


def _placed(sliced: torch.Tensor, shape: tuple[int, ...], part: Slice) -> torch.Tensor:
    """`sliced` at its place in a tensor of the whole `shape`, for a loader that narrows the whole
    tensor to its rank's part itself. The rest is never read, and never touched: its pages stay
    unmapped, so the worker holds only its slice."""
    whole = torch.empty(shape, dtype=sliced.dtype)
    whole.narrow(part.dim, part.start, part.stop - part.start).copy_(sliced)
    return whole


# compressed-tensors' quantization arguments of each microscaled format's weights (its presets
# MXFP8A16, NVFP4 and MXFP4A16), which vLLM maps to its schemes: W8A8Mxfp8, W4A4Fp4, W4A4Mxfp4.
_CT_WEIGHTS: dict[str, dict[str, Any]] = {
    "mxfp8": {"num_bits": 8, "group_size": 32, "strategy": "group", "scale_dtype": "torch.uint8"},
    "nvfp4": {"num_bits": 4, "group_size": 16, "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn"},
    "mxfp4": {"num_bits": 4, "group_size": 32, "strategy": "group", "scale_dtype": "torch.uint8"},
}
_CT_FORMAT = {"mxfp8": "mxfp8-quantized", "nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}


def compressed_tensors_config(format: str, *, ignore: Iterable[str] = ("lm_head",)) -> dict[str, Any]:
    """The `quantization_config` of a model's config.json for a checkpoint of served copies in a
    microscaled `format` (mxfp8, nvfp4, mxfp4), as vLLM reads compressed-tensors checkpoints: every
    linear layer not in `ignore` holds the served tensors; embeddings are not linear layers. Serve the
    ignored layers unscaled (the server's `fp8_pattern`): vLLM's output head takes no scales.

    NVFP4 gets the W4A4 scheme (activations quantized too, with each layer's `input_global_scale`
    from the checkpoint): vLLM's weight-only NVFP4 needs its Marlin kernel (GPUs). mxfp8 and mxfp4
    are weight-only."""
    if format not in _CT_WEIGHTS:
        raise ValueError(f"format {format!r} has no compressed-tensors layout; choose one of {', '.join(_CT_WEIGHTS)}")
    args = {"type": "float", "symmetric": True, "dynamic": False, "observer": "minmax", **_CT_WEIGHTS[format]}
    args["zp_dtype"] = args["scale_dtype"]
    # NVFP4 activations: block scales computed on the fly, under the layer's static input_global_scale
    inputs = {**args, "dynamic": "local", "observer": "static_minmax"} if format == "nvfp4" else None
    group = {"targets": ["Linear"], "weights": args, "input_activations": inputs, "output_activations": None,
             "format": _CT_FORMAT[format]}
    return {"quant_method": "compressed-tensors", "format": _CT_FORMAT[format], "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": list(ignore)}


def _calibration(model_dir: str) -> dict[str, torch.Tensor]:
    """The activation calibration tensors (`CALIBRATION`) of the checkpoint an engine started from."""
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []:
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if k.endswith(CALIBRATION)})  # noqa: SIM118
    return out


@functools.cache  # (an engine's checkpoint does not change under it: read once per process)
def _checkpoint(model_dir: str) -> dict[str, tuple[list[int], str]] | None:
    """Name -> (shape, dtype) of the safetensors checkpoint an engine was started from; None when
    it was not started from a local directory of safetensors files."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    out = {}
    for path in files:
        with open(path, "rb") as f:
            head = f.read(8)
            _, header = read_safetensors_header(head + f.read(header_length(head)))
        out.update({k: (v["shape"], v["dtype"]) for k, v in header.items() if k != "__metadata__"})
    return out


def _served_masters(manifest: Manifest) -> dict[str, tuple[tuple[int, ...], list[str]]]:
    """Master name -> (its shape, the served tensors that carry it) of a version, by the names
    `rounding.served_tensors` gives them: fp8's `_scale_inv`, the microscaled formats' `_packed`
    elements (two per byte), `_scale` block scales and NVFP4's `_global_scale`."""
    from weightsvc.rounding import BLOCK_SCALE_SUFFIX, GLOBAL_SCALE_SUFFIX, PACKED_SUFFIX
    from weightsvc.rounding import SCALE_SUFFIX as FP8_SCALE_SUFFIX

    shapes = {t.name: tuple(t.shape) for t in manifest.tensors}

    def owner(name: str) -> str | None:  # the master of a scale tensor
        for suffix in (FP8_SCALE_SUFFIX, BLOCK_SCALE_SUFFIX, GLOBAL_SCALE_SUFFIX):
            master = name.removesuffix(suffix)
            if name.endswith(suffix) and (master in shapes or master + PACKED_SUFFIX in shapes):
                return master
        return None

    out: dict[str, tuple[tuple[int, ...], list[str]]] = {}
    for name, shape in shapes.items():
        if name.endswith(PACKED_SUFFIX):
            out[name.removesuffix(PACKED_SUFFIX)] = ((shape[0], 2 * shape[1]), [name])
        elif owner(name) is None:
            out[name] = (shape, [name])
    for name in shapes:
        master = owner(name)
        if master is not None:
            out[master][1].append(name)
    return out


def check_fits(manifest: Manifest, expected: Mapping[str, tuple[list[int], str]], *, dequantize: bool = False,
               tied: Iterable[str] = ()) -> None:
    """Raise `Mismatch` unless the version has the names, shapes and kind of dtype of the checkpoint
    the engine runs: codes and block scales (fp8, uint8) in the same dtype, values in any float
    dtype. With `dequantize` its masters are compared, as values. Names the engine ties (`tied`)
    may be absent from either, and so may the engine's activation calibration (`CALIBRATION`)."""
    where = f"model {manifest.model!r} version {manifest.version}"
    if dequantize:
        served = {m: (list(shape), "values (dequantize=True)") for m, (shape, _) in _served_masters(manifest).items()}
    else:
        served = {t.name: (list(t.shape), t.dtype) for t in manifest.tensors}
    served_names = set(served) | {a for a, _ in manifest.aliases}
    for name, (_, dtype) in served.items():  # the kind of each weight first: it explains its scales
        engine = expected[name][1] if name in expected else None
        if engine is not None and _kind(dtype) != _kind(engine):
            hint = " (update with dequantize=True to load it as values)" if _kind(engine) == "values" else ""
            raise Mismatch(f"{where}: tensor {name!r} is served as {dtype}; the engine runs {engine}{hint}")
    for name, (shape, _) in served.items():
        if name not in expected:
            raise Mismatch(f"{where}: tensor {name!r} (shape {shape}) is not in the engine's checkpoint")
        if shape != list(expected[name][0]):
            raise Mismatch(f"{where}: tensor {name!r} has shape {shape}; the engine expects {expected[name][0]}")
    absent = [n for n in expected if n not in served_names and n not in tied and not n.endswith(CALIBRATION)]
    if absent:
        more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
        raise Mismatch(f"{where}: the version lacks tensor {absent[0]!r} (shape {expected[absent[0]][0]}) of the "
                       f"engine's checkpoint{more}")


def _kind(dtype: str) -> str:
    return dtype if dtype in CODE_DTYPES else "values"


def check_engine_fits(manifest: Manifest, model_config: Any, *, dequantize: bool = False) -> None:
    """`check_fits` against the checkpoint a vLLM engine was started from (its `ModelConfig`);
    nothing to check against when it was not started from a local directory."""
    expected = _checkpoint(str(model_config.model))
    if expected is not None:
        tied = ("lm_head.weight",) if getattr(model_config.hf_config, "tie_word_embeddings", False) else ()
        check_fits(manifest, expected, dequantize=dequantize, tied=tied)


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
                select.update({n: None for _, parts in _served_masters(manifest).values() if len(parts) > 1
                               for n in parts})
            sliced = {n: s for n, s in select.items() if s is not None}
            weights = client.pull(model, version, select=select) if sliced else client.pull(model, version)
            pulled = client.last_pull_bytes
        if dequantize_fp8:
            weights = {n: t.to(config.dtype) for n, t in dequantize(weights).items()}
        shapes = {t.name: t.shape for t in manifest.tensors}
        for name, part in sliced.items():
            weights[name] = _placed(weights[name], shapes[name], part)
        weights = manifest.with_aliases(weights)
        if getattr(hf, "tie_word_embeddings", False) and "lm_head.weight" not in weights:
            # vLLM's in-place reload keeps the head it had unless it is given one (the version's
            # checkpoint omits the tied name): hand it the embeddings under the head's name.
            embed = next((n for n in weights if n.endswith("embed_tokens.weight")), None)
            if embed is not None:
                weights["lm_head.weight"] = weights[embed]
        # vLLM's in-place reload rebuilds a layer from what it is given: the checkpoint's calibration too.
        weights.update({n: t for n, t in _calibration(str(config.model)).items() if n not in weights})
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


def __getattr__(name: str) -> type[VllmWorkerExtension]:
    # `weightsvc.loaders.VllmCpuEmulationExtension` (a `worker_extension_cls`) is resolved only in vLLM's
    # workers: its module imports vLLM, which weightsvc itself never does.
    if name == "VllmCpuEmulationExtension":
        from weightsvc._vllm_cpu import VllmCpuEmulationExtension

        return VllmCpuEmulationExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _alive(llm: Any) -> bool:
    """Whether every worker of a vLLM engine still answers (after a failed update: died, or refused?).
    Asked from a thread of its own: a call into an engine whose process died can wait forever."""
    answer: queue.SimpleQueue[bool] = queue.SimpleQueue()

    def ask() -> None:
        try:
            llm.collective_rpc("weightsvc_alive")
            answer.put(True)
        except Exception:
            answer.put(False)

    threading.Thread(target=ask, name="weightsvc-vllm-alive", daemon=True).start()
    try:
        return answer.get(timeout=ALIVE_TIMEOUT_S)
    except queue.Empty:
        return False


def update_vllm(
    llm: Any,
    target: str,
    model: str = "default",
    version: int | str = "latest",
    *,
    client_id: str | None = None,
    dequantize: bool = False,
) -> int:
    """Load a version into every worker of a vLLM `LLM` and ack it; returns the version.

    The version is resolved here, once, so that all tensor-parallel workers load the same one even
    if a new version commits meanwhile. `dequantize` loads an fp8 version as values into an engine
    that runs a higher precision. The prefix cache is reset afterwards (its KV entries were computed
    with the old weights). A version that does not fit raises `Mismatch` before any worker writes
    a weight; an engine that fails or dies during the update raises, and nothing is acked."""

    def load(_client: InferenceClient, m: Manifest) -> None:
        config = getattr(llm, "model_config", None)
        if config is not None:  # refused here, before any worker starts; each worker checks again
            check_engine_fits(m, config, dequantize=dequantize)
        try:
            llm.collective_rpc("weightsvc_load", args=(target, model, m.version, dequantize))
        except Exception as e:
            if _alive(llm):  # a load that failed in a live engine: its own error says why
                raise
            raise RuntimeError(f"model {model!r} version {m.version}: the vLLM engine died during the update "
                               f"({type(e).__name__}: {e}); it was not acked") from e
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()

    return _update(target, model, version, client_id, load)
