"""Block scales of the microscaled formats: OCP MX (mxfp8, mxfp4) and NVFP4.

A block is `fmt.block` consecutive elements of a row; the formats apply only to rows whose length K
is a multiple of it (`ExportSpec.format_for`), so the block of flat element g is g // block.

Scales come from the exact max of |finite value| of each block (NaN/Inf ignored), computed where
the values are (numpy, or torch on any device) and turned into scales here on the host, so every
path gets the same scales. They are rounded UP, so that no element of a block clips: clipping at
the format max would bias `sr` and `ef`.

- MX (UE8M0): scale 2^e with the smallest e such that amax <= elem_max * 2^e (elem_max 448 for
  e4m3, 6 for e2m1), e in [-127, e_max]; an all-zero block gets e = 0. Served code: e + 127.
  e_max (119 for e4m3, 125 for e2m1) is the largest e whose elem_max * 2^e is a finite fp32, so
  that every served value is: a block whose max is above elem_max * 2^e_max (2.66e38, 2.55e38)
  saturates there.
- NVFP4: a global scale per tensor (see the convention below) and a float8_e4m3fn scale per block
  of 16, the smallest e4m3 at or above block_amax / 6 * gs, capped at 448; a zero block gets 0.
  Only the block(s) holding the max of the tensor (or of its fused group) can need more than 448,
  by less than 2^-24 relatively (the rounding of gs): they get 448, and their max lies above
  6 * scale by less than 2^-23 relatively (rtn serves 6; sr serves 6 except with a probability
  below 2^-21, when it rounds towards 8 and saturates).

The kernels get per block `scale`, the effective fp32 dequant multiplier (2^e, or e4m3 / gs in
fp32), and round u / scale exactly (`_cpu`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from weightsvc.rounding._codes import decode
from weightsvc.rounding._formats import FORMATS, SCALE_ROW, Format, Scales

if TYPE_CHECKING:
    import torch

_E4M3 = FORMATS["fp8_e4m3"]
_E4M3_VALUES = decode(np.arange(_E4M3.max_bits + 1, dtype=np.uint8), _E4M3)  # codes 0..448, increasing
_UE8M0_BIAS = 127
_UE8M0_NAN = 0xFF


def check_block_shape(shape: tuple[int, ...], fmt: Format) -> tuple[int, int]:
    if len(shape) != 2 or shape[1] % fmt.block:
        raise ValueError(f"{fmt.name} takes 2-D tensors whose rows are a multiple of {fmt.block} long, not {shape}")
    return shape[0], shape[1]


def block_amax(values: np.ndarray, fmt: Format) -> np.ndarray:
    """Max of |finite value| of each block of a 2-D float32 array: (N, K / block), float32."""
    n, k = check_block_shape(values.shape, fmt)
    magnitude = np.abs(np.where(np.isfinite(values), values, np.float32(0)))
    return magnitude.reshape(n, k // fmt.block, fmt.block).max(axis=2, initial=np.float32(0))


def block_scales(values: np.ndarray, fmt: Format, group_amax: float | None = None) -> Scales:
    """The block scales of a 2-D float32 array (the master, or m + e for ef) in a microscaled format.
    `group_amax`: NVFP4's global scale from this max |value| (of the tensors that share it:
    `fused_group`) rather than from the tensor's own."""
    return scales_from_block_amax(block_amax(values, fmt), fmt, group_amax)


def block_scales_torch(values: torch.Tensor, fmt: Format, group_amax: float | None = None) -> Scales:
    """`block_scales` of a float32 tensor on any device: the maxima where the values are (exact, so
    equal to numpy's), the scales on the host."""
    import torch

    n, k = check_block_shape(tuple(values.shape), fmt)
    if values.numel() == 0:
        return scales_from_block_amax(np.zeros((n, k // fmt.block), np.float32), fmt, group_amax)
    magnitude = torch.where(torch.isfinite(values), values, 0).abs()
    amax = magnitude.reshape(n, k // fmt.block, fmt.block).amax(dim=2)
    return scales_from_block_amax(amax.float().cpu().numpy(), fmt, group_amax)


def scales_from_block_amax(amax: np.ndarray, fmt: Format, group_amax: float | None = None) -> Scales:
    """The scales of blocks with these (exact) maxima of |value|, shape (N, K / block); NVFP4's
    global scale from `group_amax` when given (at least the tensor's own max), else the tensor's."""
    amax = np.asarray(amax, np.float32)
    global_scale = None
    if fmt.scale_encoding == "ue8m0":
        codes = (_ue8m0_exponents(amax, fmt.max_value) + _UE8M0_BIAS).astype(np.uint8)
    else:
        own = amax.max(initial=np.float32(0))
        if group_amax is not None and np.float32(group_amax) < own:
            raise ValueError(f"group max {group_amax} is below the tensor's own max {own}")
        gs = nvfp4_global_scale(own if group_amax is None else group_amax)
        global_scale = np.array([gs], np.float32)
        codes = _e4m3_at_or_above(_nvfp4_block_target(amax, gs, fmt.max_value))
    scale = block_scale_values(codes, fmt, global_scale)
    return Scales(scale, SCALE_ROW, fmt.block, 1, codes, global_scale)


def block_scale_values(codes: np.ndarray, fmt: Format, global_scale: np.ndarray | None = None) -> np.ndarray:
    """The fp32 dequant multiplier of each block from its served code (and NVFP4's global scale):
    what the kernels multiply element values by, and what loaders should."""
    codes = np.asarray(codes, np.uint8)
    if fmt.scale_encoding == "ue8m0":
        power = np.ldexp(np.float32(1), codes.astype(np.int32) - _UE8M0_BIAS)  # 2^-127 is an fp32 subnormal
        return np.where(codes == _UE8M0_NAN, np.float32(np.nan), power).astype(np.float32)
    if global_scale is None:
        raise ValueError(f"{fmt.name} block scales need the global scale")
    return _nvfp4_dequant(decode(codes, _E4M3), np.float32(np.asarray(global_scale, np.float32).reshape(-1)[0]))


def _ue8m0_exponents(amax: np.ndarray, elem_max: float) -> np.ndarray:
    """The smallest e with amax <= elem_max * 2^e, exactly (in float64, where elem_max * 2^e and
    the comparison are exact), clamped to [-127, e_max]; 0 for a zero block."""
    a = amax.astype(np.float64)
    _, e = np.frexp(a / elem_max)  # a / elem_max <= 2^e, up to the rounding of the division:
    e = e.astype(np.int32)  # the exact checks below settle it either way
    e = np.where(np.ldexp(elem_max, e - 1) >= a, e - 1, e)
    e = np.where(np.ldexp(elem_max, e) < a, e + 1, e)
    return np.clip(np.where(a == 0, 0, e), -_UE8M0_BIAS, _mx_max_exponent(elem_max))


def _mx_max_exponent(elem_max: float) -> int:
    """The largest e whose elem_max * 2^e is a finite fp32 (119 for e4m3's 448, 125 for e2m1's 6):
    above it, the block's largest element values would serve as 2^128, which is Inf in fp32."""
    return int(np.floor(np.log2(np.finfo(np.float32).max / elem_max)))


def _e4m3_at_or_above(target: np.ndarray) -> np.ndarray:
    """The float8_e4m3fn codes of the smallest values >= target (target >= 0), capped at 448."""
    codes = np.searchsorted(_E4M3_VALUES, np.asarray(target, np.float64), side="left")
    return np.minimum(codes, _E4M3.max_bits).astype(np.uint8)


# NVFP4's global scale: compressed-tensors' convention. The served global scale is
# gs = 448 * 6 / tensor_amax, block scales are encoded as block_amax / 6 * gs, and a value is
# fp4 * block_scale / gs. The direction (encode or decode multiplier) differs between toolchains:
# to flip it, change these three functions only.
_NVFP4_GS_MAX = np.float32(2.0**117)  # keeps the smallest block scale, 2^-9 / gs, a normal fp32


def nvfp4_global_scale(tensor_amax: float | np.floating) -> np.float32:
    """gs = 448 * 6 / amax in fp32 (1 for an all-zero tensor), at most 2^117 (amax below ~1.6e-32),
    so that every block's dequant multiplier and its reciprocal stay finite."""
    amax = np.float32(tensor_amax)
    if amax == 0:
        return np.float32(1)
    with np.errstate(over="ignore"):
        gs = np.float32(448 * 6) / amax
    return np.float32(min(gs, _NVFP4_GS_MAX))


def _nvfp4_block_target(block_amax: np.ndarray, gs: np.float32, elem_max: float) -> np.ndarray:
    """The block scale before its e4m3 encoding (float64; rounded up by the caller)."""
    return block_amax.astype(np.float64) / elem_max * np.float64(gs)


def _nvfp4_dequant(block_scale: np.ndarray, gs: np.float32) -> np.ndarray:
    """The effective dequant multiplier of each block: e4m3 value / gs, one fp32 division."""
    return (np.asarray(block_scale, np.float32) / gs).astype(np.float32)
