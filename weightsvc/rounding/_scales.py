"""The scales of a scaled tensor, from its exact maxima of |value|: fp8's per tensor, row or
128x128 block (the microscaled formats' block scales are in `_microscale`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from weightsvc.rounding._formats import BLOCK, SCALE_BLOCK, SCALE_ROW, SCALE_TENSOR, Format, Scales
from weightsvc.rounding._microscale import block_scales, block_scales_torch

if TYPE_CHECKING:
    import torch


def fp8_scales(values: np.ndarray, fmt: Format, scaling: str, group_amax: float | None = None) -> Scales:
    """Scales of a 2-D float32 array: amax / format max per tensor, row or 128x128 block.

    An all-zero group (and a non-finite amax) gets scale 1, never a division by zero.
    Microscaled formats get their block scales (`block_scales`; `scaling` does not apply; NVFP4's
    global scale from `group_amax` when given).
    """
    if fmt.block:
        return block_scales(values, fmt, group_amax)
    n, k = values.shape
    magnitude = np.abs(np.where(np.isfinite(values), values, np.float32(0)))
    if scaling == "tensor":
        amax = np.asarray(magnitude.max(initial=np.float32(0)), dtype=np.float32)
    elif scaling == "channel":
        amax = magnitude.max(axis=1, keepdims=True, initial=np.float32(0))
    else:
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = np.zeros((nb * BLOCK, kb * BLOCK), np.float32)
        padded[:n, :k] = magnitude
        amax = padded.reshape(nb, BLOCK, kb, BLOCK).max(axis=(1, 3))
    return scales_from_amax(amax, fmt, scaling, k)


def scales_from_amax(amax: np.ndarray, fmt: Format, scaling: str, cols: int) -> Scales:
    """The fp8 scales of groups with these (exact) maxima of |value|; shared by the CPU and CUDA
    paths (microscaled formats: `scales_from_block_amax`)."""
    if fmt.block:
        raise ValueError(f"{fmt.name} has block scales: use scales_from_block_amax")
    scale_inv = np.array(np.asarray(amax, np.float32) / np.float32(fmt.max_value), dtype=np.float32)
    # A zero group gets 1; a tiny one at least the smallest normal (its reciprocal, which an engine
    # may take, stays finite).
    scale_inv[scale_inv == 0] = 1
    np.maximum(scale_inv, np.float32(2.0**-126), out=scale_inv)
    mode = {"tensor": SCALE_TENSOR, "channel": SCALE_ROW, "block": SCALE_BLOCK}[scaling]
    return Scales(scale_inv, mode, cols, -(-cols // BLOCK))


def fp8_scales_torch(values: torch.Tensor, fmt: Format, scaling: str, group_amax: float | None = None) -> Scales:
    """fp8_scales for a torch tensor on any device: the maxima where the values are (exact, so equal
    to the numpy path's), the small rest on the host."""
    import torch

    if fmt.block:
        return block_scales_torch(values, fmt, group_amax)
    n, k = values.shape
    magnitude = torch.where(torch.isfinite(values), values, 0).abs()
    if scaling == "tensor":
        amax = magnitude.max() if magnitude.numel() else torch.zeros((), device=values.device)
    elif scaling == "channel":
        amax = magnitude.amax(dim=1, keepdim=True) if k else torch.zeros((n, 1), device=values.device)
    else:
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = torch.zeros((nb * BLOCK, kb * BLOCK), dtype=torch.float32, device=values.device)
        padded[:n, :k] = magnitude
        amax = padded.reshape(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3))
    return scales_from_amax(amax.float().cpu().numpy(), fmt, scaling, k)


def element_scales(scales: Scales, indices: np.ndarray) -> np.ndarray:
    """The dequant multiplier of each flat element index of a scaled tensor (any scaled format:
    a microscaling block is a "row" of `block` elements)."""
    flat = scales.scale_inv.reshape(-1)
    if scales.mode == SCALE_TENSOR:
        return np.broadcast_to(flat[0], indices.shape)
    rows = indices // scales.cols
    if scales.mode == SCALE_ROW:
        return flat[rows]
    return flat[(rows // BLOCK) * scales.block_cols + (indices - rows * scales.cols) // BLOCK]


def group_amax(values: Iterable[np.ndarray]) -> float:
    """The max |finite value| over arrays (the masters, or m + e, of a fused group): exact."""
    top = np.float32(0)
    for v in values:  # (NaN/Inf left out in place: no copy of the finite elements)
        top = max(top, np.abs(v).max(initial=np.float32(0), where=np.isfinite(v)))
    return float(top)
