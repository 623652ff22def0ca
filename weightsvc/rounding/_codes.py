"""Served codes: their values (for metrics and tests, not the hot path) and FP4 packing."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from weightsvc.rounding._formats import Format

if TYPE_CHECKING:
    import torch

_DECODE_TABLES: dict[str, np.ndarray] = {}

Codes = TypeVar("Codes", np.ndarray, "torch.Tensor")


def decode(codes: np.ndarray, fmt: Format) -> np.ndarray:
    """The float32 values of served codes, one per element (before any scale; unpack FP4 first)."""
    if fmt.name == "bf16":
        return (codes.astype(np.uint32) << 16).view(np.float32)
    if fmt.name == "fp16":
        return codes.astype(np.uint16).view(np.float16).astype(np.float32)
    table = _DECODE_TABLES.get(fmt.name)
    if table is None:
        sign_bit = 1 << (fmt.width - 1)
        table = np.empty(1 << fmt.width, np.float32)
        for code in range(table.size):
            mag = code & (sign_bit - 1)
            exp, mant = mag >> fmt.mantissa, mag & ((1 << fmt.mantissa) - 1)
            if fmt.specials and mag == fmt.inf_bits:
                value = math.inf
            elif fmt.specials and mag > fmt.max_bits:
                value = math.nan
            elif exp == 0:
                value = math.ldexp(mant, fmt.emin - fmt.mantissa)
            else:
                value = math.ldexp(mant | 1 << fmt.mantissa, exp - fmt.bias - fmt.mantissa)
            table[code] = -value if code & sign_bit else value
        _DECODE_TABLES[fmt.name] = table
    return table[codes.astype(np.uint8)]


def pack(codes: Codes) -> Codes:
    """Two 4-bit codes per byte (uint8, numpy or torch): element 2i in the low nibble, 2i + 1 in the
    high one, as compressed-tensors lays out FP4. The one place that knows the order (with unpack)."""
    return codes[0::2] | (codes[1::2] << 4)


def unpack(packed: np.ndarray) -> np.ndarray:
    """The 4-bit codes of packed bytes, one per element (uint8, flat): the inverse of `pack`."""
    flat = np.ascontiguousarray(packed).reshape(-1).view(np.uint8)
    codes = np.empty(flat.size * 2, np.uint8)
    codes[0::2] = flat & 0xF
    codes[1::2] = flat >> 4
    return codes
