"""Fair Cast: the one entry point that turns fp32 masters into their served copy.

The service, the `weightsvc export` command and learners all call these functions, so the served
bits are the same wherever they are computed. Functions are pure: arrays in, arrays out, every key
explicit (seed, version, tensor name, flat element offset); the EF residual is passed in and the
new one handed back, never kept here.

    served = fair_cast(master, format="bf16", rounding="sr", seed=0, version=step, name="w")
    out = export_state_dict(state_dict, ExportSpec("fp8_e4m3", "ef"), version=step, residual=res)

Importing the package loads neither numba nor torch nor Triton: the kernels load when one first
runs, torch with the tensor functions.
"""

from __future__ import annotations

from weightsvc.rounding._codes import decode, pack, unpack
from weightsvc.rounding._export import (
    export_array,
    export_device,
    export_runs,
    export_runs_tensor,
    export_tensor,
    use_threads,
)
from weightsvc.rounding._formats import (
    BLOCK,
    DEFAULT_FP8_PATTERN,
    DEVICES,
    FORMATS,
    MICROSCALED,
    ROUNDINGS,
    SCALINGS,
    Format,
    Scales,
    check_choice,
)
from weightsvc.rounding._keys import tensor_key
from weightsvc.rounding._layout import (
    BLOCK_SCALE_SUFFIX,
    GLOBAL_SCALE_SUFFIX,
    PACKED_SUFFIX,
    ROLES,
    SCALE_SUFFIX,
    Role,
    fused_group,
    master_of,
    master_shape,
    served_masters,
    served_scales,
    served_tensors,
)
from weightsvc.rounding._microscale import (
    block_scale_values,
    block_scales,
    block_scales_torch,
    nvfp4_global_scale,
    scales_from_block_amax,
)
from weightsvc.rounding._residual import RESIDUAL_FORMAT_KEY, RESIDUAL_SCALING_KEY, RESIDUAL_VERSION_KEY, Residual
from weightsvc.rounding._scales import element_scales, fp8_scales, fp8_scales_torch, group_amax, scales_from_amax
from weightsvc.rounding._spec import ExportSpec, ExportStats, check_export, run_keys
from weightsvc.rounding._torch import dequantize, export, export_state_dict, fair_cast

__all__ = [
    "BLOCK",
    "BLOCK_SCALE_SUFFIX",
    "DEFAULT_FP8_PATTERN",
    "DEVICES",
    "FORMATS",
    "GLOBAL_SCALE_SUFFIX",
    "MICROSCALED",
    "PACKED_SUFFIX",
    "RESIDUAL_FORMAT_KEY",
    "RESIDUAL_SCALING_KEY",
    "RESIDUAL_VERSION_KEY",
    "ROLES",
    "ROUNDINGS",
    "SCALE_SUFFIX",
    "SCALINGS",
    "ExportSpec",
    "ExportStats",
    "Format",
    "Residual",
    "Role",
    "Scales",
    "block_scale_values",
    "block_scales",
    "block_scales_torch",
    "check_choice",
    "check_export",
    "decode",
    "dequantize",
    "element_scales",
    "export",
    "export_array",
    "export_device",
    "export_runs",
    "export_runs_tensor",
    "export_state_dict",
    "export_tensor",
    "fair_cast",
    "fp8_scales",
    "fp8_scales_torch",
    "fused_group",
    "group_amax",
    "master_of",
    "master_shape",
    "nvfp4_global_scale",
    "pack",
    "run_keys",
    "scales_from_amax",
    "scales_from_block_amax",
    "served_masters",
    "served_scales",
    "served_tensors",
    "tensor_key",
    "unpack",
    "use_threads",
]
