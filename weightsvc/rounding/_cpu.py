"""Fused CPU kernels (numba): one pass over the fp32 master, at memory speed.

Bit recipes (FIELD.md): work on the fp32 bit pattern as uint32. Round to nearest even adds
0x7FFF plus the kept lsb; stochastic rounding adds a uniform integer over the 16 discarded bits;
both then keep the top 16 bits. NaN and Inf are handled before the add (a NaN payload must not
carry into Inf), and a finite value that would round to Inf saturates to the largest finite bf16.
Unsigned 32-bit adds cannot overflow here: the largest finite pattern plus 0xFFFF stays below 2**32.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_EXP_MASK = np.uint32(0x7F800000)
_MANT_MASK = np.uint32(0x007FFFFF)
_BF16_QNAN_BIT = np.uint32(0x0040)
_BF16_INF_MAG = np.uint32(0x7F80)
_BF16_MAG_MASK = np.uint32(0x7FFF)


@njit(inline="always")
def _mix32(x):  # type: ignore[no-untyped-def]
    # "lowbias32" integer hash (a bijection on uint32 with good avalanche).
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


@njit(inline="always")
def random_bits(k0, k1, index):  # type: ignore[no-untyped-def]
    """32 random bits for flat element `index` (uint64) under key (k0, k1)."""
    lo = np.uint32(index & np.uint64(0xFFFFFFFF))
    hi = np.uint32(index >> np.uint64(32))
    return _mix32(_mix32(lo ^ k0) ^ (hi + k1))


@njit(parallel=True, nogil=True, cache=True)
def bf16_export(master, served, k0, k1, offset, stochastic):  # type: ignore[no-untyped-def]
    """master: uint32 view of fp32 (1-D); served: uint16 view of bf16 (1-D, same length).

    Returns (nonfinite, saturated) element counts.
    """
    nonfinite = 0
    saturated = 0
    base = np.uint64(offset)
    for i in prange(master.size):
        bits = master[i]
        if (bits & _EXP_MASK) == _EXP_MASK:
            # NaN stays NaN (quiet bit set, sign kept), Inf stays Inf.
            out = bits >> np.uint32(16)
            if (bits & _MANT_MASK) != np.uint32(0):
                out |= _BF16_QNAN_BIT
            nonfinite += 1
        else:
            if stochastic:
                add = random_bits(k0, k1, base + np.uint64(i)) & np.uint32(0xFFFF)
            else:
                add = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            out = (bits + add) >> np.uint32(16)
            if (out & _BF16_MAG_MASK) == _BF16_INF_MAG:
                out -= np.uint32(1)  # saturate to +-max finite, never Inf
                saturated += 1
        served[i] = np.uint16(out)
    return nonfinite, saturated
