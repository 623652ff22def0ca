"""The served tensors of a master, both ways: which served tensors a master becomes (names, shapes,
dtypes), and which master (and which part of it) a served tensor is. Also which masters share a
global scale (`fused_group`)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Literal

import numpy as np

from weightsvc.rounding._formats import BLOCK, Format, Scales
from weightsvc.rounding._microscale import check_block_shape

SCALE_SUFFIX = "_scale_inv"  # fp8
BLOCK_SCALE_SUFFIX = "_scale"  # microscaled formats: the block scale codes
GLOBAL_SCALE_SUFFIX = "_global_scale"  # NVFP4
PACKED_SUFFIX = "_packed"  # FP4: two elements per byte

# What a served tensor holds of its master: the elements as they are, the elements two per byte
# (FP4), fp8's fp32 dequant multipliers, the microscaled block scales, NVFP4's global scale.
Role = Literal["elements", "packed", "scale_inv", "block_scale", "global_scale"]
ROLES: tuple[Role, ...] = ("elements", "packed", "scale_inv", "block_scale", "global_scale")
# (the longest suffix first: `_global_scale` also ends in `_scale`)
_SCALE_ROLES: tuple[tuple[str, Role], ...] = (
    (GLOBAL_SCALE_SUFFIX, "global_scale"), (SCALE_SUFFIX, "scale_inv"), (BLOCK_SCALE_SUFFIX, "block_scale"),
)


def served_tensors(
    name: str, shape: tuple[int, ...], fmt: Format, scaling: str = "block"
) -> list[tuple[str, tuple[int, ...], str]]:
    """The served tensors of master `name` of this shape in `fmt`, in order: (served name, shape,
    safetensors dtype). The one place that names them (the service, `export` and the loaders ask
    here; `served_masters` reads the names back):
    - unscaled: the tensor itself;
    - fp8: `{name}` and `{name}_scale_inv` (fp32 dequant multipliers, `scaling`'s layout: DeepSeek-V3's);
    - the microscaled formats, in the layout of compressed-tensors checkpoints, which vLLM loads
      (for `x.weight`: `x.weight_packed`, `x.weight_scale`, `x.weight_global_scale`):
      - mxfp8: `{name}` (float8_e4m3fn (N, K)) and `{name}_scale` (UE8M0 codes, uint8 (N, K / 32));
      - mxfp4: `{name}_packed` (E2M1 codes two per byte, element 2i in the low nibble: uint8
        (N, K / 2)) and `{name}_scale` (UE8M0, uint8 (N, K / 32));
      - nvfp4: `{name}_packed` (as mxfp4), `{name}_scale` (float8_e4m3fn (N, K / 16)) and
        `{name}_global_scale` (fp32 (1,); values are fp4 * scale / global scale)."""
    if not fmt.scaled:
        return [(name, shape, fmt.safetensors_dtype)]
    if not fmt.block:
        n, k = shape
        scale_shape = {"tensor": (), "channel": (n, 1)}.get(scaling, (-(-n // BLOCK), -(-k // BLOCK)))
        return [(name, shape, fmt.safetensors_dtype), (name + SCALE_SUFFIX, scale_shape, "F32")]
    n, k = check_block_shape(shape, fmt)
    elements = (name + PACKED_SUFFIX, (n, k // 2)) if fmt.packed else (name, (n, k))
    scale_dtype = "F8_E4M3" if fmt.scale_encoding == "e4m3" else "U8"
    out: list[tuple[str, tuple[int, ...], str]] = [
        (*elements, fmt.safetensors_dtype),
        (name + BLOCK_SCALE_SUFFIX, (n, k // fmt.block), scale_dtype),
    ]
    if fmt.global_scale:
        out.append((name + GLOBAL_SCALE_SUFFIX, (1,), "F32"))
    return out


def served_scales(scales: Scales, fmt: Format) -> list[np.ndarray]:
    """The arrays of a scaled tensor's served scale tensors, in `served_tensors`' order (flat)."""
    if not fmt.block:
        return [scales.scale_inv.reshape(-1)]
    assert scales.codes is not None
    arrays = [scales.codes.reshape(-1)]
    if fmt.global_scale:
        assert scales.global_scale is not None
        arrays.append(scales.global_scale.reshape(-1))
    return arrays


def master_of(name: str, served: Collection[str]) -> tuple[str, Role]:
    """The master served tensor `name` belongs to, and what it holds of it, among the served tensors
    `served` of one version (the inverse of `served_tensors`). A `_packed` tensor is FP4 elements;
    a tensor with a scale's suffix is a scale when its master's elements are served too; any other
    is a master's elements."""
    if name.endswith(PACKED_SUFFIX):
        return name.removesuffix(PACKED_SUFFIX), "packed"
    for suffix, role in _SCALE_ROLES:
        master = name.removesuffix(suffix)
        if name.endswith(suffix) and (master in served or master + PACKED_SUFFIX in served):
            return master, role
    return name, "elements"


def served_masters(served: Iterable[str]) -> dict[str, list[str]]:
    """Master name -> its served tensors among `served` (the names of one version's served tensors),
    in `served_tensors`' order: the elements first, then the scales. Masters come in the order of
    their elements in `served`."""
    names = list(served)
    known = set(names)
    roles = {name: master_of(name, known) for name in names}
    out: dict[str, list[str]] = {}
    for name, (master, role) in roles.items():
        if role in ("elements", "packed"):
            out.setdefault(master, []).append(name)
    scales = [name for name, (_, role) in roles.items() if role not in ("elements", "packed")]
    for name in sorted(scales, key=lambda n: ROLES.index(roles[n][1])):
        out[roles[name][0]].append(name)
    return out


def master_shape(role: Role, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A master's shape from the served shape of its elements (`role` "packed": two per byte)."""
    return (*shape[:-1], 2 * shape[-1]) if role == "packed" else tuple(shape)


# The tensors an engine fuses into one layer (vLLM's packed modules: q, k and v projections into
# qkv_proj, gate and up into gate_up_proj). They share NVFP4's global scale (an engine keeps one per
# fused layer: vLLM keeps the largest, and the other shards' values would be read wrongly), so they
# are placed together: one replica computes that scale from all of them.
_FUSED = re.compile(r"^(.*\.)(?:(q|k|v)_proj|(gate|up)_proj)(\.[^.]+)$")


def fused_group(name: str) -> str:
    """The name of the layer an engine fuses tensor `name` into (`...qkv_proj.weight`,
    `...gate_up_proj.weight`); the name itself for any other tensor."""
    m = _FUSED.match(name)
    if m is None:
        return name
    return f"{m.group(1)}{'qkv_proj' if m.group(2) else 'gate_up_proj'}{m.group(4)}"
