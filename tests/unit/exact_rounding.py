"""The oracle of scaled rounding: the exact quotient x / scale (Python fractions) placed on the
grid of an ml_dtypes format. Independent of the kernels: no fp32 arithmetic, no code of ours."""

from __future__ import annotations

from bisect import bisect_left
from fractions import Fraction

import ml_dtypes
import numpy as np

DTYPES = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
          "mxfp8": ml_dtypes.float8_e4m3fn, "nvfp4": ml_dtypes.float4_e2m1fn, "mxfp4": ml_dtypes.float4_e2m1fn}


def grid(fmt: str) -> list[Fraction]:
    """The finite non-negative values of the format, increasing: value i has magnitude code i."""
    dtype = DTYPES[fmt]
    width = 4 if dtype == ml_dtypes.float4_e2m1fn else 8
    codes = np.arange(1 << (width - 1), dtype=np.uint8)
    finite = [Fraction(float(v)) for v in codes.view(dtype).astype(np.float64) if np.isfinite(v)]
    assert finite == sorted(finite) and len(set(finite)) == len(finite)
    return finite


def quotients(master: np.ndarray, scale: np.ndarray) -> list[Fraction]:
    """|x| / scale, exactly (a zero scale: its block is all zeros, quotient 0)."""
    return [Fraction(abs(float(x))) / Fraction(float(s)) if s else Fraction(0)
            for x, s in zip(master.reshape(-1).tolist(), np.broadcast_to(scale, master.shape).reshape(-1).tolist(),
                            strict=True)]


def half_even_codes(master: np.ndarray, scale: np.ndarray, fmt: str) -> np.ndarray:
    """The codes of x / scale rounded half to even on the format's grid, saturating at its max (one
    code per element, sign in the top bit of the format's width)."""
    values = grid(fmt)
    sign_bit = 8 if DTYPES[fmt] == ml_dtypes.float4_e2m1fn else 0x80
    out = []
    for q, negative in zip(quotients(master, scale), np.signbit(master).reshape(-1).tolist(), strict=True):
        i = bisect_left(values, q)
        if i == len(values):
            code = i - 1
        elif values[i] == q or i == 0:
            code = i
        else:
            below, above = q - values[i - 1], values[i] - q
            code = i - 1 if below < above or (below == above and (i - 1) % 2 == 0) else i
        out.append(code | (sign_bit if negative else 0))
    return np.array(out, np.uint8).reshape(master.shape)


def differences(master: np.ndarray, got: np.ndarray, expected: np.ndarray) -> list[tuple[float, int, int]]:
    """(x, served code, expected code) of the first few elements where they differ: an assertion's message."""
    wrong = np.flatnonzero(got.reshape(-1) != expected.reshape(-1))[:5]
    return [(float(master.reshape(-1)[i]), int(got.reshape(-1)[i]), int(expected.reshape(-1)[i])) for i in wrong]
