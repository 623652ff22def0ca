"""Fused CPU kernels (numba): one pass over the fp32 master, at memory speed.

Every kernel works on the fp32 bit pattern as unsigned integers, so the result is exact and the
same on any machine (the Triton kernels in `_triton.py` follow the same recipes step for step):

- bf16: round to nearest even adds 0x7FFF plus the kept lsb; stochastic rounding adds a uniform
  integer over the 16 discarded bits; both keep the top 16 bits (FIELD.md). NaN and Inf are handled
  first (a NaN payload must not carry into Inf) and a finite value that would round to Inf saturates.
- other formats: the 24-bit significand is shifted right by `s` bits, where `s` grows in the
  target's subnormal range; SR adds uniform random bits over all `s` discarded bits (at most 32:
  beyond that the bias is below 2**-32 of a target ulp), RTN rounds half to even. The result is
  re-encoded in the target and saturated to its largest finite value.
- fp8 values are first multiplied by the fp32 reciprocal of their scale (tensor, row or 128x128
  block; a microscaling block of a row is a "row" of `block` elements); `ef` adds the fp32
  residual first and keeps `u - served` as the new residual.
- 4-bit formats (E2M1) are written one code per byte (`width` 4: the sign is bit 3); the caller
  packs two per byte. E2M1 has no NaN/Inf: `nan_bits` 0 and `inf_bits` 7 serve them as +-0, +-6.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from weightsvc.rounding._formats import SCALE_BLOCK, SCALE_NONE, SCALE_ROW, SCALE_TENSOR

_EXP_MASK = np.uint32(0x7F800000)
_MANT_MASK = np.uint32(0x007FFFFF)
_BF16_QNAN_BIT = np.uint32(0x0040)
_BF16_INF_MAG = np.uint32(0x7F80)
_BF16_MAG_MASK = np.uint32(0x7FFF)

__all__ = ["SCALE_BLOCK", "SCALE_NONE", "SCALE_ROW", "SCALE_TENSOR", "bf16_export", "bf16_export_ef",
           "bf16_export_runs", "float_export", "random_bits"]  # fmt: skip


@njit(inline="always")
def _mix32(x):  # type: ignore[no-untyped-def]
    # "lowbias32" integer hash (a bijection on uint32 with good avalanche). numba widens integer
    # arithmetic to 64 bits, so every step is truncated back to 32 explicitly.
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32(x * np.uint32(0x7FEB352D))
    x = np.uint32(x ^ (x >> np.uint32(15)))
    x = np.uint32(x * np.uint32(0x846CA68B))
    return np.uint32(x ^ (x >> np.uint32(16)))


@njit(inline="always")
def random_bits(k0, k1, index):  # type: ignore[no-untyped-def]
    """32 random bits for flat element `index` (uint64) under key (k0, k1)."""
    lo = np.uint32(index & np.uint64(0xFFFFFFFF))
    hi = np.uint32(index >> np.uint64(32))
    return _mix32(np.uint32(_mix32(np.uint32(lo ^ k0)) ^ np.uint32(hi + k1)))


@njit(inline="always")
def _bf16_round(bits, add):  # type: ignore[no-untyped-def]
    """(served bits, saturated) of a finite fp32 pattern plus the rounding increment `add`."""
    out = (bits + add) >> np.uint32(16)
    if (out & _BF16_MAG_MASK) == _BF16_INF_MAG:
        return out - np.uint32(1), 1  # saturate to +-max finite, never Inf
    return out, 0


@njit(inline="always")
def _bf16_special(bits):  # type: ignore[no-untyped-def]
    # NaN stays NaN (quiet bit set, sign kept), Inf stays Inf.
    out = bits >> np.uint32(16)
    if (bits & _MANT_MASK) != np.uint32(0):
        out |= _BF16_QNAN_BIT
    return out


@njit(inline="always")
def _bf16_one(bits, k0, k1, index, stochastic):  # type: ignore[no-untyped-def]
    """(served bits, nonfinite, saturated) of fp32 pattern `bits`, flat element `index` of its tensor."""
    if (bits & _EXP_MASK) == _EXP_MASK:
        return _bf16_special(bits), 1, 0
    if stochastic:
        add = random_bits(k0, k1, index) & np.uint32(0xFFFF)
    else:
        add = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out, sat = _bf16_round(bits, add)
    return out, 0, sat


@njit(parallel=True, nogil=True, cache=True)
def bf16_export(master, served, k0, k1, offset, stochastic):  # type: ignore[no-untyped-def]
    """master: uint32 view of fp32 (1-D); served: uint16 (same length). Returns (nonfinite, saturated)."""
    nonfinite = 0
    saturated = 0
    base = np.uint64(offset)
    for i in prange(master.size):
        out, nf, sat = _bf16_one(master[i], k0, k1, base + np.uint64(i), stochastic)
        nonfinite += nf
        saturated += sat
        served[i] = np.uint16(out)
    return nonfinite, saturated


@njit(nogil=True, cache=True)
def bf16_export_runs(master, served, starts, outs, offsets, k0s, k1s, stochastic, counts):  # type: ignore[no-untyped-def]
    """Many small runs in one call, each exactly as `bf16_export` would: run j is
    master[starts[j]:starts[j + 1]] (uint32 view of fp32), elements offsets[j]... of a tensor keyed
    (k0s[j], k1s[j]), written to served[outs[j]:] (uint16). counts[j] = (nonfinite, saturated)."""
    for j in range(starts.size - 1):
        base = np.uint64(offsets[j])
        start, out_at = starts[j], outs[j]
        nonfinite = 0
        saturated = 0
        for i in range(starts[j + 1] - start):
            out, nf, sat = _bf16_one(master[start + i], k0s[j], k1s[j], base + np.uint64(i), stochastic)
            nonfinite += nf
            saturated += sat
            served[out_at + i] = np.uint16(out)
        counts[j, 0] = nonfinite
        counts[j, 1] = saturated


@njit(parallel=True, nogil=True, cache=True)
def bf16_export_ef(master, served, residual, new_residual):  # type: ignore[no-untyped-def]
    """Error feedback to bf16: u = m + e, s = RTN(u), e' = u - s (exact), written to `new_residual`."""
    nonfinite = 0
    saturated = 0
    mbits = master.view(np.uint32)
    for i in prange(master.size):
        if (mbits[i] & _EXP_MASK) == _EXP_MASK:
            served[i] = np.uint16(_bf16_special(mbits[i]))
            new_residual[i] = np.float32(0.0)  # a non-finite master resets its residual
            nonfinite += 1
            continue
        # u = m + e; with e == 0, u is m itself, so -0 keeps its sign.
        u = master[i] if residual[i] == 0 else master[i] + residual[i]
        bits = _f32_bits(np.float32(u))
        if (bits & _EXP_MASK) == _EXP_MASK:  # m + e overflowed: serve the saturated master
            bits = mbits[i]
            u = master[i]
        out, sat = _bf16_round(bits, np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        saturated += sat
        served[i] = np.uint16(out)
        # A saturated element keeps no residual: the error beyond the range would only wind up.
        res = u - _f32_from_bits(np.uint32(out << np.uint32(16)))
        new_residual[i] = np.float32(0.0) if sat or res == 0 else res  # +0, whatever the sign of a zero
    return nonfinite, saturated


@intrinsic
def _f32_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """The bits of a float32 as a uint32: one register move (a bitcast), no memory."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f32_from_bits(typingctx, b):  # type: ignore[no-untyped-def]
    """The float32 of these uint32 bits (a bitcast)."""
    if b != types.uint32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


@njit(inline="always")
def _scale_index(g, mode, cols, block_cols, cols_shift):  # type: ignore[no-untyped-def]
    if mode == SCALE_TENSOR:
        return 0
    # a shift where the row length is a power of two (the microscaling blocks): a division costs
    # more than the rest of an element's export
    row = g >> cols_shift if cols_shift >= 0 else g // cols
    if mode == SCALE_ROW:
        return row
    return (row // 128) * block_cols + (g - row * cols) // 128


@njit(inline="always")
def _round_to_format(bits, r, stochastic, mantissa, bias, emin, max_bits):  # type: ignore[no-untyped-def]
    """Round a finite fp32 pattern to the target format.

    Returns (magnitude bits, saturated).
    """
    expf = np.int64((bits >> np.uint32(23)) & np.uint32(0xFF))
    mant = np.int64(bits & _MANT_MASK)
    if expf == 0:
        e = np.int64(-126)
        sig = mant
    else:
        e = expf - 127
        sig = mant | np.int64(1 << 23)
    big_e = max(e, np.int64(emin))
    s = 23 - mantissa + (big_e - e)
    if stochastic:
        if s <= 32:
            q = (sig + (np.int64(r) & ((np.int64(1) << s) - 1))) >> s
        elif s < 56:
            q = np.int64(1) if np.int64(r) < (sig >> (s - 32)) else np.int64(0)
        else:
            q = np.int64(0)  # P(up) = sig / 2**s < 2**-32: below the resolution of 32 random bits
    elif s <= 40:
        # half to even without a branch on the discarded bits (random data mispredicts it): add just
        # under half, plus the kept lsb, and shift
        q = (sig + (np.int64(1) << (s - 1)) - 1 + ((sig >> s) & 1)) >> s
    else:
        q = np.int64(0)
    saturated = 0
    if q == 0:
        mag = np.int64(0)
    elif big_e == emin and q < (np.int64(1) << mantissa):
        mag = q  # subnormal
    else:
        if q >= (np.int64(1) << (mantissa + 1)):
            q >>= 1
            big_e += 1
        mag = ((big_e + bias) << mantissa) | (q - (np.int64(1) << mantissa))
        if mag > max_bits:
            mag = np.int64(max_bits)
            saturated = 1
    return mag, saturated


# 2^e for the exponents of every format's served values (fp32's range and beyond): a table lookup
# where `math.ldexp`, a call per element, cost most of the export.
_POW2_MIN = -160
_POW2 = np.ldexp(1.0, np.arange(_POW2_MIN, 160))


@njit(inline="always")
def _served_value(mag, negative, mantissa, bias, emin):  # type: ignore[no-untyped-def]
    """The number that magnitude bits `mag` of the target format encode, with its sign: float64, exact."""
    if (mag >> mantissa) == 0:  # zero or subnormal
        value = float(mag) * _POW2[emin - mantissa - _POW2_MIN]
    else:
        significand = (mag & ((1 << mantissa) - 1)) | (1 << mantissa)
        value = float(significand) * _POW2[(mag >> mantissa) - bias - mantissa - _POW2_MIN]
    return -value if negative else value


@njit(parallel=True, nogil=True, cache=True)
def float_export(  # type: ignore[no-untyped-def]
    master,
    served,
    k0,
    k1,
    offset,
    stochastic,
    mantissa,
    bias,
    emin,
    max_bits,
    nan_bits,
    inf_bits,
    width,
    inv_scales,
    scales,
    scale_mode,
    cols,
    block_cols,
    residual,
    new_residual,
    use_residual,
):
    """Any format: master float32 (1-D), served uint8/uint16 (same length). Returns (nonfinite, saturated)."""
    nonfinite = 0
    saturated = 0
    base = np.uint64(offset)
    sign_shift = np.int64(width - 1)
    mbits = master.view(np.uint32)
    cols_shift = np.int64(-1)
    if cols > 0 and (cols & (cols - 1)) == 0:
        cols_shift = np.int64(0)
        while (np.int64(1) << cols_shift) < cols:
            cols_shift += 1
    for i in prange(master.size):
        bits = mbits[i]
        sign = np.int64(bits >> np.uint32(31))
        if (bits & _EXP_MASK) == _EXP_MASK:
            is_nan = (bits & _MANT_MASK) != np.uint32(0)
            mag = nan_bits if (is_nan or inf_bits < 0) else inf_bits
            served[i] = (sign << sign_shift) | mag
            if use_residual:
                new_residual[i] = np.float32(0.0)
            nonfinite += 1
            continue
        u = master[i]
        if use_residual and residual[i] != 0:  # with e == 0, u is m itself (-0 keeps its sign)
            u = u + residual[i]
        g = base + np.uint64(i)
        scale = np.float32(1.0)
        if scale_mode != SCALE_NONE:
            k = _scale_index(np.int64(g), scale_mode, cols, block_cols, cols_shift)
            y = u * inv_scales[k]
            scale = scales[k]
        else:
            y = u
        ybits = _f32_bits(np.float32(y))
        overflow = (ybits & _EXP_MASK) == _EXP_MASK
        if overflow:  # overflowed while scaling or adding the residual
            ybits = (ybits & np.uint32(0x80000000)) | np.uint32(0x7F7FFFFF)
        r = random_bits(k0, k1, g) if stochastic else np.uint32(0)
        mag, sat = _round_to_format(ybits, r, stochastic, mantissa, bias, emin, max_bits)
        saturated += sat
        served[i] = (np.int64(ybits >> np.uint32(31)) << sign_shift) | mag
        if use_residual:
            # A saturated element keeps no residual: the error beyond the range would only wind up.
            value = _served_value(mag, ybits >> np.uint32(31), mantissa, bias, emin)
            res = u - np.float32(value) * scale
            new_residual[i] = np.float32(0.0) if (sat or overflow or res == 0) else res  # +0 for any zero
    return nonfinite, saturated
