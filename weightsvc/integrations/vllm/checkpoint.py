"""A version against the checkpoint a vLLM engine was started from: the names, shapes and kinds of
dtype it must have to load in place, and the compressed-tensors `quantization_config` of a
checkpoint of served copies in a microscaled format."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from weightsvc.errors import subject
from weightsvc.integrations._common import Mismatch
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.safetensors import header_length, read_safetensors_header

__all__ = ["CALIBRATION", "CODE_DTYPES", "FP8_DTYPES", "calibration", "check_engine_fits", "check_fits",
           "compressed_tensors_config"]

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
# Codes and block scales are loaded bit for bit: served and engine dtypes must be the same. Any other
# dtype is values, which an engine casts to its own precision.
CODE_DTYPES = (*FP8_DTYPES, "U8")
# Activation calibration of a checkpoint (NVFP4 W4A4's per-layer input scale): not trained, so never
# in a version; the engine keeps its checkpoint's (`VllmWorkerExtension` reloads them with each version).
CALIBRATION = (".input_global_scale",)

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


def calibration(model_dir: str) -> dict[str, torch.Tensor]:
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


def served_masters(manifest: Manifest) -> dict[str, tuple[tuple[int, ...], list[str]]]:
    """Master name -> (its shape, the served tensors that carry it) of a version: the inverse of the
    served naming (`rounding.served_masters`), with each master's shape from its elements'."""
    from weightsvc import rounding

    shapes = {t.name: tuple(t.shape) for t in manifest.tensors}
    out = {}
    for master, served in rounding.served_masters(shapes).items():
        _, role = rounding.master_of(served[0], shapes)
        out[master] = (rounding.master_shape(role, shapes[served[0]]), served)
    return out


def check_fits(manifest: Manifest, expected: Mapping[str, tuple[list[int], str]], *, dequantize: bool = False,
               tied: Iterable[str] = ()) -> None:
    """Raise `Mismatch` unless the version has the names, shapes and kind of dtype of the checkpoint
    the engine runs: codes and block scales (fp8, uint8) in the same dtype, values in any float
    dtype. With `dequantize` its masters are compared, as values. Names the engine ties (`tied`)
    may be absent from either, and so may the engine's activation calibration (`CALIBRATION`)."""
    where = subject(manifest.model, manifest.version)
    if dequantize:
        served = {m: (list(shape), "values (dequantize=True)") for m, (shape, _) in served_masters(manifest).items()}
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
