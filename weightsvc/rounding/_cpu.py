"""Fused CPU kernels (numba): one pass over the fp32 master, at memory speed.

Every kernel works on the fp32 bit pattern as unsigned integers, so the result is exact and the
same on any machine (the Triton kernels in `_triton.py` follow the same recipes step for step):

- bf16: round to nearest even adds 0x7FFF plus the kept lsb; stochastic rounding adds a uniform
  integer over the 16 discarded bits; both keep the top 16 bits. NaN and Inf are handled
  first (a NaN payload must not carry into Inf) and a finite value that would round to Inf saturates.
- other formats: the 24-bit significand is shifted right by `s` bits, where `s` grows in the
  target's subnormal range; SR adds uniform random bits over the `s` discarded bits when there
  are at most 32, and beyond rounds up when the 32 random bits are below sig / 2**(s - 32) (from
  s = 56 on never: the chance is below 2**-32); RTN rounds half to even. The result is re-encoded
  in the target and saturated to its largest finite value.
- scaled formats round the quotient u / scale (tensor, row or 128x128 block; a microscaling block
  of a row is a "row" of `block` elements) exactly, as if it were computed with infinite precision:
  the fp32 division (rounded to nearest) is turned into the quotient rounded to odd, with the sign
  of the remainder u - q * scale, exact in float64 (q * scale has 48 bits). Every value and every
  midpoint of an 8- or 4-bit format is an even fp32 number (at most 5 significant bits, all of
  them normal fp32), so the quotient rounded to odd lies on the same side of each as the exact
  quotient, and on one only where the exact quotient is: half to even and sr then pick exactly
  what they would pick for the exact quotient, and sr never leaves its two neighbours. (The
  division rounded to nearest alone is not enough: u / scale can lie within half an fp32 ulp of a
  midpoint without being one, and then rounds onto it.)
  `ef` adds the fp32 residual first and keeps `u - served` as the new residual.
- the other formats' kernel goes run by run of elements that share a scale, each run a loop
  without a branch (selects, bounded shifts), which the compiler turns into SIMD code.
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
_MAG_MASK = np.uint32(0x7FFFFFFF)
# The least fp32 magnitude (bits) that can leave bf16's finite range: rounding adds at most 0xFFFF.
BF16_EXTREME = np.uint32(0x7F7F0001)

__all__ = ["BF16_EXTREME", "SCALE_BLOCK", "SCALE_NONE", "SCALE_ROW", "SCALE_TENSOR", "bf16_counts", "bf16_export",
           "bf16_export_ef", "bf16_export_runs", "float_export", "random_bits"]


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


@njit(inline="always")
def _bf16_bits(bits, k0, k1, index, stochastic):  # type: ignore[no-untyped-def]
    """The served bits `_bf16_one` gives, with selects for its branches, so that a loop of it vectorizes."""
    if stochastic:
        add = random_bits(k0, k1, index) & np.uint32(0xFFFF)
    else:
        add = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = np.uint32(np.uint32(bits + add) >> np.uint32(16))  # (wraps for NaN/Inf, served below instead)
    out = np.uint32(out - np.uint32((out & _BF16_MAG_MASK) == _BF16_INF_MAG))
    nan = np.uint32(_BF16_QNAN_BIT if (bits & _MANT_MASK) != np.uint32(0) else np.uint32(0))
    special = np.uint32((bits >> np.uint32(16)) | nan)
    return special if (bits & _EXP_MASK) == _EXP_MASK else out


@njit(parallel=True, nogil=True, cache=True)
def bf16_export(master, served, k0, k1, offset, stochastic):  # type: ignore[no-untyped-def]
    """master: uint32 view of fp32 (1-D); served: uint16 (same length). Returns the largest
    magnitude's bits: from BF16_EXTREME on, `bf16_counts` counts what was non-finite or saturated.
    (Counting here would keep the loop from vectorizing: twice the time; the max costs nothing.)"""
    top = np.uint32(0)
    base = np.uint64(offset)
    for i in prange(master.size):
        bits = master[i]
        served[i] = np.uint16(_bf16_bits(bits, k0, k1, base + np.uint64(i), stochastic))
        top = max(top, np.uint32(bits & _MAG_MASK))
    return top


@njit(inline="always")
def _bf16_counts(master, k0, k1, base, stochastic):  # type: ignore[no-untyped-def]
    nonfinite = 0
    saturated = 0
    for i in range(master.size):
        if (master[i] & _MAG_MASK) >= BF16_EXTREME:
            _, nf, sat = _bf16_one(master[i], k0, k1, base + np.uint64(i), stochastic)
            nonfinite += nf
            saturated += sat
    return nonfinite, saturated


@njit(nogil=True, cache=True)
def bf16_counts(master, k0, k1, offset, stochastic):  # type: ignore[no-untyped-def]
    """(nonfinite, saturated) of `bf16_export` with the same arguments."""
    return _bf16_counts(master, k0, k1, np.uint64(offset), stochastic)


@njit(nogil=True, cache=True)
def bf16_export_runs(master, served, starts, outs, offsets, k0s, k1s, stochastic, counts):  # type: ignore[no-untyped-def]
    """Many small runs in one call, each exactly as `bf16_export` would: run j is
    master[starts[j]:starts[j + 1]] (uint32 view of fp32), elements offsets[j]... of a tensor keyed
    (k0s[j], k1s[j]), written to served[outs[j]:] (uint16). counts[j] = (nonfinite, saturated)."""
    for j in range(starts.size - 1):
        base = np.uint64(offsets[j])
        start, out_at = starts[j], outs[j]
        top = np.uint32(0)
        for i in range(starts[j + 1] - start):
            bits = master[start + i]
            served[out_at + i] = np.uint16(_bf16_bits(bits, k0s[j], k1s[j], base + np.uint64(i), stochastic))
            top = max(top, np.uint32(bits & _MAG_MASK))
        counts[j, 0] = 0
        counts[j, 1] = 0
        if top >= BF16_EXTREME:
            counts[j, 0], counts[j, 1] = _bf16_counts(master[start : starts[j + 1]], k0s[j], k1s[j], base, stochastic)


@njit(parallel=True, nogil=True, cache=True)
def bf16_export_ef(master, served, residual, new_residual):  # type: ignore[no-untyped-def]
    """Error feedback to bf16: u = m + e, s = RTN(u), e' = u - s (exact), written to `new_residual`.
    Selects, not branches, so that the loop vectorizes (its counts are sums: they vectorize too)."""
    nonfinite = 0
    saturated = 0
    mbits = master.view(np.uint32)
    for i in prange(master.size):
        special = (mbits[i] & _EXP_MASK) == _EXP_MASK  # served as NaN/Inf, its residual reset
        # u = m + e; with e == 0, u is m itself, so -0 keeps its sign.
        u = master[i] if residual[i] == 0 else master[i] + residual[i]
        bits = _f32_bits(np.float32(u))
        over = (bits & _EXP_MASK) == _EXP_MASK  # m + e overflowed: serve the saturated master
        bits = mbits[i] if over else bits
        u = master[i] if over else u
        out = np.uint32(np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        sat = (out & _BF16_MAG_MASK) == _BF16_INF_MAG
        out = np.uint32(out - np.uint32(sat))
        # A saturated element keeps no residual: the error beyond the range would only wind up.
        res = u - _f32_from_bits(np.uint32(out << np.uint32(16)))
        new_residual[i] = np.float32(0.0) if sat or special or res == 0 else res  # +0, whatever the sign of a zero
        served[i] = np.uint16(_bf16_special(mbits[i]) if special else out)
        nonfinite += np.int64(special)
        saturated += np.int64(sat and not special)
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
    """Round a finite fp32 pattern to the target format: (magnitude bits, saturated). Without a
    branch: selects, and shifts bounded where they would leave 64 bits, as the Triton kernel does,
    so that the compiler turns the loop into SIMD code."""
    expf = np.int64((bits >> np.uint32(23)) & np.uint32(0xFF))
    mant = np.int64(bits & _MANT_MASK)
    e = np.int64(-126) if expf == 0 else expf - 127
    sig = mant if expf == 0 else mant | np.int64(1 << 23)
    big_e = max(e, np.int64(emin))
    s = 23 - mantissa + (big_e - e)
    if stochastic:  # (the same for every element: the compiler hoists it out of the loop)
        rand = np.int64(r)
        s_lo = min(s, np.int64(32))
        q_lo = (sig + (rand & ((np.int64(1) << s_lo) - 1))) >> s_lo
        # beyond 32 discarded bits: up when the 32 random bits are below sig / 2**(s - 32); from 56
        # on P(up) < 2**-32, below their resolution
        s_hi = min(max(s, np.int64(32)) - 32, np.int64(23))
        q_hi = np.int64((s < 56) & (rand < (sig >> s_hi)))
        q = q_lo if s <= 32 else q_hi
    else:
        # half to even without a branch on the discarded bits: add just under half, plus the kept
        # lsb, and shift; from s = 25 on, every bit of sig (< 2**24) is discarded and below half
        s_c = min(s, np.int64(25))
        q = (sig + (np.int64(1) << (s_c - 1)) - 1 + ((sig >> s_c) & 1)) >> s_c
    carry = q >= (np.int64(1) << (mantissa + 1))
    q = q >> 1 if carry else q
    big_e = big_e + 1 if carry else big_e
    subnormal = (big_e == emin) & (q < (np.int64(1) << mantissa))
    normal = ((big_e + bias) << mantissa) | (q - (np.int64(1) << mantissa))
    mag = np.int64(0) if q == 0 else (q if subnormal else normal)
    saturated = mag > max_bits
    return (np.int64(max_bits) if saturated else mag), saturated


@njit(inline="always")
def _served_value(mag, mantissa, bias, emin):  # type: ignore[no-untyped-def]
    """The magnitude that bits `mag` of the target format encode, as a float32 (exact): the
    significand times a power of two made from its exponent bits (every one of a format's
    exponents is a normal float32 exponent)."""
    subnormal = (mag >> mantissa) == 0
    significand = mag if subnormal else (mag & ((1 << mantissa) - 1)) | (1 << mantissa)
    exponent = (emin - mantissa) if subnormal else (mag >> mantissa) - bias - mantissa
    return np.float32(significand) * _f32_from_bits(np.uint32((exponent + 127) << 23))


@njit(inline="always")
def _quotient_bits(u, scale):  # type: ignore[no-untyped-def]
    """The bits of u / scale rounded to odd in fp32 (module docstring), and whether it overflowed
    (or u is NaN/Inf). A zero scale (an all-zero block: its u are +-0) divides by one."""
    d = scale if scale > 0 else np.float32(1)
    q = np.float32(u / d)  # rounded to nearest
    qbits = _f32_bits(q)
    overflow = (qbits & _EXP_MASK) == _EXP_MASK
    remainder = np.float64(u) - np.float64(q) * np.float64(d)  # exact
    # Inexact and even: one ulp towards the exact quotient (up in magnitude where the remainder
    # has u's sign). q == 0 with u != 0 (an underflow) steps up: its remainder is u.
    step = (remainder != 0) & ((qbits & np.uint32(1)) == 0)
    up = (remainder > 0) == (u > 0)
    ybits = qbits + np.uint32(1) if up else qbits - np.uint32(1)
    return (ybits if step else qbits), overflow


@njit(inline="always")
def _float_one(bits, u, scaled, scale, g, k0, k1, stochastic, f):  # type: ignore[no-untyped-def]
    """One element: master bits `bits`, u = m (+ e), divided by its `scale` where `scaled`; flat
    index `g` in its tensor; `f`: the format (`float_export`'s `_format`). Returns (served bits,
    non-finite, saturated, magnitude bits, bits of the scaled value, no residual to keep). No
    branch but on `scaled` and `stochastic`, the same for every element and constants where it is
    inlined: the loops around it become SIMD code."""
    mantissa, bias, emin, max_bits, nan_bits, inf_bits, sign_shift = f
    special = (bits & _EXP_MASK) == _EXP_MASK
    if scaled:
        ybits, overflow = _quotient_bits(u, scale)
    else:
        ybits = _f32_bits(np.float32(u))
        overflow = (ybits & _EXP_MASK) == _EXP_MASK
    # NaN/Inf masters, and values that overflowed while scaling or adding the residual, round as the
    # largest finite magnitude (no NaN bits through the shifts); a master's NaN/Inf is then served
    # as the format's NaN/Inf (or saturates).
    ybits = (_f32_bits(np.float32(u)) & np.uint32(0x80000000)) | np.uint32(0x7F7FFFFF) if overflow else ybits
    r = random_bits(k0, k1, g) if stochastic else np.uint32(0)
    mag, sat = _round_to_format(ybits, r, stochastic, mantissa, bias, emin, max_bits)
    is_nan = (bits & _MANT_MASK) != np.uint32(0)
    special_mag = nan_bits if (is_nan | (inf_bits < 0)) else inf_bits
    sign = np.int64(bits >> np.uint32(31)) if special else np.int64(ybits >> np.uint32(31))
    out = (sign << sign_shift) | (special_mag if special else mag)
    # A saturated element keeps no ef residual: the error beyond the range would only wind up.
    return out, special, sat & ~special, mag, ybits, overflow | sat | special


@njit(inline="always")
def _float_run(mbits, master, served, lo, hi, base, scaled, scale, k0, k1, stochastic, f):  # type: ignore[no-untyped-def]
    """Elements lo:hi, which share one scale: (non-finite, saturated)."""
    nonfinite = 0
    saturated = 0
    for i in range(lo, hi):
        out, special, sat, _, _, _ = _float_one(mbits[i], master[i], scaled, scale, base + np.uint64(i), k0, k1,
                                                stochastic, f)
        served[i] = out
        nonfinite += special
        saturated += sat
    return nonfinite, saturated


@njit(inline="always")
def _float_run_ef(mbits, master, served, residual, new_residual, lo, hi, base, scaled, scale, k0, k1, stochastic, f):  # type: ignore[no-untyped-def]
    """`_float_run` with error feedback: u = m + e is exported, e' = u - served (exact)."""
    nonfinite = 0
    saturated = 0
    for i in range(lo, hi):
        e = residual[i]
        u = master[i] + e if e != 0 else master[i]  # (with e == 0, u is m itself: -0 keeps its sign)
        out, special, sat, mag, ybits, drop = _float_one(mbits[i], u, scaled, scale, base + np.uint64(i), k0, k1,
                                                           stochastic, f)
        served[i] = out
        nonfinite += special
        saturated += sat
        value = _served_value(mag, f[0], f[1], f[2])
        res = u - (-value if (ybits >> np.uint32(31)) else value) * scale
        new_residual[i] = np.float32(0.0) if (drop | (res == 0)) else res  # +0 for any zero
    return nonfinite, saturated


@njit(inline="always")
def _scale_run_end(g, mode, cols, cols_shift):  # type: ignore[no-untyped-def]
    """The flat index after the last element that shares element g's scale."""
    if mode in (SCALE_NONE, SCALE_TENSOR):
        return np.int64(1) << 62
    row = g >> cols_shift if cols_shift >= 0 else g // cols
    row_end = (row + 1) * cols
    if mode == SCALE_ROW:
        return row_end
    return min(row_end, row * cols + ((g - row * cols) // 128 + 1) * 128)


@njit(nogil=True, cache=True)
def _float_span(master, served, k0, k1, base, stochastic, f, scales, scale_mode, cols, block_cols,  # type: ignore[no-untyped-def]
                cols_shift, residual, new_residual, use_residual, lo, hi):
    """`float_export` of elements lo:hi, run by run of elements that share a scale: a run's loop
    has no branch and one scale, and the compiler turns it into SIMD code (2-3x the speed of a
    loop that looks its scale up per element)."""
    nonfinite = 0
    saturated = 0
    mbits = master.view(np.uint32)
    i = lo
    while i < hi:
        g = np.int64(base) + i
        end = min(hi, i + _scale_run_end(g, scale_mode, cols, cols_shift) - g)
        scaled = scale_mode != SCALE_NONE
        scale = np.float32(1.0)
        if scaled:
            scale = scales[_scale_index(g, scale_mode, cols, block_cols, cols_shift)]
        # `scaled` as a constant at each call: its loop is compiled without the branch, which the
        # compiler would not hoist (an unscaled export runs 1.5x as fast without it)
        if use_residual and scaled:
            nf, sat = _float_run_ef(mbits, master, served, residual, new_residual, i, end, base, True, scale, k0,
                                    k1, stochastic, f)
        elif use_residual:
            nf, sat = _float_run_ef(mbits, master, served, residual, new_residual, i, end, base, False, scale, k0,
                                    k1, stochastic, f)
        elif scaled:
            nf, sat = _float_run(mbits, master, served, i, end, base, True, scale, k0, k1, stochastic, f)
        else:
            nf, sat = _float_run(mbits, master, served, i, end, base, False, scale, k0, k1, stochastic, f)
        nonfinite += nf
        saturated += sat
        i = end
    return nonfinite, saturated


_SPAN = 1 << 16  # elements a thread exports in one go


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
    scales,
    scale_mode,
    cols,
    block_cols,
    residual,
    new_residual,
    use_residual,
):
    """Any format: master float32 (1-D), served uint8/uint16 (same length). Returns (nonfinite, saturated)."""
    f = (np.int64(mantissa), np.int64(bias), np.int64(emin), np.int64(max_bits), np.int64(nan_bits),
         np.int64(inf_bits), np.int64(width - 1))
    cols_shift = np.int64(-1)
    if cols > 0 and (cols & (cols - 1)) == 0:
        cols_shift = np.int64(0)
        while (np.int64(1) << cols_shift) < cols:
            cols_shift += 1
    nonfinite = 0
    saturated = 0
    for j in prange((master.size + _SPAN - 1) // _SPAN):
        nf, sat = _float_span(master, served, k0, k1, np.uint64(offset), stochastic, f, scales,
                              scale_mode, cols, block_cols, cols_shift, residual, new_residual, use_residual,
                              j * _SPAN, min((j + 1) * _SPAN, master.size))
        nonfinite += nf
        saturated += sat
    return nonfinite, saturated
