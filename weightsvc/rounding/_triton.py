"""Triton kernels for CUDA: the recipes of `_cpu.py`, step for step, so the bits are identical.

Tested on the CPU under `TRITON_INTERPRET=1` against the numba kernels, bit for bit. Launched with
`enable_fp_fusion=False`: the ef residual `u - value * scale` must not become an FMA on the GPU,
or its last bit would differ from the CPU's. A zero residual is stored as +0 on both sides: the GPU
does not keep the IEEE sign of `-0 - -0` (seen on an H200).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from weightsvc.rounding._formats import SCALE_BLOCK, SCALE_ROW, Format

# How the elementwise kernels are launched: elements per program and warps per program. The bits do
# not depend on them; `weightsvc.cli.bench.gpu.cuda_kernel_profile` measures the choices on a GPU.
LAUNCH = {"block": 1024, "num_warps": 4}


@triton.jit
def _mix32(x):
    # Products are truncated to 32 bits explicitly: the interpreter widens uint32 * int to int64.
    x ^= x >> 16
    x = (x * 0x7FEB352D).to(tl.uint32)
    x ^= x >> 15
    x = (x * 0x846CA68B).to(tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def _random_bits(k0, k1, g):
    lo = (g & 0xFFFFFFFF).to(tl.uint32)
    hi = (g >> 32).to(tl.uint32)
    return _mix32(_mix32(lo ^ k0.to(tl.uint32)) ^ (hi + k1.to(tl.uint32)).to(tl.uint32))


@triton.jit
def _count(counts, special, saturated, COUNT: tl.constexpr):
    """Add a block's non-finite and saturated elements to the counters. Most blocks have none and
    skip the atomics: thousands of blocks adding zeros to one address would serialize on it.
    (COUNT=False only to measure what counting costs.)"""
    if not COUNT:
        return
    # One 32-bit reduction for both (a block holds < 2**16 elements): a reduction costs instructions
    # and barriers in every block, most of which have nothing to count.
    both = tl.sum(special.to(tl.int32) | (saturated.to(tl.int32) << 16))
    if both != 0:
        tl.atomic_add(counts + 0, (both & 0xFFFF).to(tl.int64))
        tl.atomic_add(counts + 1, (both >> 16).to(tl.int64))


@triton.jit
def _load_master(src, residual, i, mask, EF: tl.constexpr):
    """The master, its bits, whether it is NaN/Inf, and u = m + e (u = m when e == 0: -0 keeps its sign)."""
    m = tl.load(src + i, mask=mask, other=0.0)
    mbits = m.to(tl.uint32, bitcast=True)
    special = (mbits & 0x7F800000) == 0x7F800000
    u = m
    if EF:
        e = tl.load(residual + i, mask=mask, other=0.0)
        u = tl.where(e == 0, m, m + e)
    return m, mbits, special, u


@triton.jit
def _bf16_block(src, dst, residual, new_residual, r, mask, g0, k0, k1, STOCHASTIC: tl.constexpr, EF: tl.constexpr):
    """Export elements `r` (where `mask`) to bf16: element r of the pointers is element g0 + r of
    its tensor (the random bits' counter). Returns which were non-finite and which saturated."""
    m, mbits, special, u = _load_master(src, residual, r, mask, EF)
    bits = u.to(tl.uint32, bitcast=True)
    if EF:  # m + e overflowed: serve the saturated master
        over = (bits & 0x7F800000) == 0x7F800000
        bits = tl.where(over, mbits, bits)
        u = tl.where(over, m, u)
    if STOCHASTIC:
        add = _random_bits(k0, k1, g0 + r) & 0xFFFF
    else:
        add = 0x7FFF + ((bits >> 16) & 1)
    out = (bits + add) >> 16
    sat = (out & 0x7FFF) == 0x7F80
    out = tl.where(sat, out - 1, out)
    nan_or_inf = (mbits >> 16) | tl.where((mbits & 0x7FFFFF) != 0, 0x40, 0).to(tl.uint32)
    out = tl.where(special, nan_or_inf, out)
    tl.store(dst + r, out.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    if EF:
        served = (out << 16).to(tl.float32, bitcast=True)
        e = u - served
        tl.store(new_residual + r, tl.where(special | sat | (e == 0), 0.0, e), mask=mask)
    return special & mask, sat & ~special & mask


@triton.jit
def _bf16_kernel(src, dst, residual, new_residual, counts, n, k0, k1, offset,
                 STOCHASTIC: tl.constexpr, EF: tl.constexpr, BLOCK: tl.constexpr, COUNT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    special, sat = _bf16_block(src, dst, residual, new_residual, i, i < n, offset, k0, k1, STOCHASTIC, EF)
    _count(counts, special, sat, COUNT)


@triton.jit
def _bf16_runs_kernel(src, dst, blocks, keys, counts, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    """Many small runs (tensors, or pieces of them) in one launch, each element exactly as
    `_bf16_kernel` exports it. Program b exports one block of one run: `blocks[b]` = (its first
    element in src, the end of its run, the flat index of that first element in its tensor, the
    run); `keys[run]` = (k0, k1); the run's counters are counts[2 * run : 2 * run + 2]."""
    b = tl.program_id(0).to(tl.int64) * 4
    start = tl.load(blocks + b)
    end = tl.load(blocks + b + 1)
    first = tl.load(blocks + b + 2)
    run = tl.load(blocks + b + 3)
    r = tl.arange(0, BLOCK)
    mask = r < tl.minimum(end - start, BLOCK).to(tl.int32)
    k0 = tl.load(keys + 2 * run)
    k1 = tl.load(keys + 2 * run + 1)
    special, sat = _bf16_block(src + start, dst + start, src, src, r, mask, first, k0, k1, STOCHASTIC, False)
    _count(counts + 2 * run, special, sat, True)


@triton.jit
def _float_kernel(src, dst, residual, new_residual, scales, counts, n, k0, k1, offset,
                  cols, block_cols, MANT: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr,
                  MAX_BITS: tl.constexpr, NAN_BITS: tl.constexpr, INF_BITS: tl.constexpr, WIDTH: tl.constexpr,
                  SCALE_MODE: tl.constexpr, COLS_SHIFT: tl.constexpr, STOCHASTIC: tl.constexpr,
                  EF: tl.constexpr, BLOCK: tl.constexpr, COUNT: tl.constexpr):
    # As in `_bf16_kernel`: pointers at the block's first element, 32-bit offsets r from it.
    base = tl.program_id(0).to(tl.int64) * BLOCK
    r = tl.arange(0, BLOCK)
    mask = r < tl.minimum(n - base, BLOCK).to(tl.int32)
    g0 = offset + base  # the block's first element in its tensor
    _, mbits, special, u = _load_master(src + base, residual + base, r, mask, EF)
    scale = tl.full([BLOCK], 1.0, tl.float32)
    ybits = u.to(tl.uint32, bitcast=True)
    overflow = (ybits & 0x7F800000) == 0x7F800000
    if SCALE_MODE != 0:
        if SCALE_MODE == 1:
            first_scale, k = 0, r * 0
        elif SCALE_MODE == 2 and COLS_SHIFT >= 0:
            # Rows of a power-of-two length (every microscaling block): shifts, the per-element part
            # 32-bit. (g0 + r) >> S = (g0 >> S) + ((g0 mod 2^S + r) >> S).
            first_scale = g0 >> COLS_SHIFT
            k = ((g0 & ((1 << COLS_SHIFT) - 1)).to(tl.int32) + r) >> COLS_SHIFT
        elif SCALE_MODE == 2:
            first_scale, k = 0, (g0 + r) // cols
        elif COLS_SHIFT >= 0:  # 128 x 128 blocks of rows of a power-of-two length
            g = g0 + r
            first_scale, k = 0, ((g >> COLS_SHIFT) >> 7) * block_cols + ((g & ((1 << COLS_SHIFT) - 1)) >> 7)
        else:
            g = g0 + r
            row = g // cols
            first_scale, k = 0, (row // 128) * block_cols + (g - row * cols) // 128
        scale = tl.load(scales + first_scale + k, mask=mask, other=1.0)
        # u / scale rounded to odd (`_cpu._quotient_bits`): div_rn, not `/` (an approximate division)
        d = tl.where(scale > 0, scale, 1.0)
        q = tl.math.div_rn(u, d)
        qbits = q.to(tl.uint32, bitcast=True)
        overflow = (qbits & 0x7F800000) == 0x7F800000
        remainder = u.to(tl.float64) - q.to(tl.float64) * d.to(tl.float64)
        step = (remainder != 0) & ((qbits & 1) == 0)
        up = (remainder > 0) == (u > 0)
        ybits = tl.where(step, tl.where(up, qbits + 1, qbits - 1), qbits)
    ybits = tl.where(overflow, (u.to(tl.uint32, bitcast=True) & 0x80000000) | 0x7F7FFFFF, ybits)
    # 32-bit integers throughout (a 64-bit operation takes two or three instructions): sig < 2**24,
    # and the shifts are bounded where they would leave 32 bits.
    expf = ((ybits >> 23) & 0xFF).to(tl.int32)
    mant = (ybits & 0x7FFFFF).to(tl.int32)
    e = tl.where(expf == 0, -126, expf - 127)
    sig = tl.where(expf == 0, mant, mant | (1 << 23))
    big_e = tl.maximum(e, EMIN)
    s = 23 - MANT + (big_e - e)
    if STOCHASTIC:
        rand = _random_bits(k0, k1, g0 + r)
        sig_u = sig.to(tl.uint32)
        # s < 32: add the low s random bits and truncate (the sum < 2**24 + 2**31 fits)
        s_lo = tl.minimum(s, 31).to(tl.uint32)
        low = rand & (tl.full([BLOCK], 0xFFFFFFFF, tl.uint32) >> (32 - s_lo))
        q_lo = (sig_u + low) >> s_lo
        # s == 32: the carry out of sig + rand; 32 < s < 56: up when rand < sig / 2**(s - 32)
        q_32 = ((sig_u + rand).to(tl.uint32) < rand).to(tl.uint32)
        s_hi = (tl.minimum(tl.maximum(s, 32) - 32, 23)).to(tl.uint32)  # every shift stays defined
        q_hi = ((s < 56) & (rand < (sig_u >> s_hi))).to(tl.uint32)
        q = tl.where(s < 32, q_lo, tl.where(s == 32, q_32, q_hi)).to(tl.int32)
    else:
        # half to even; from s = 25 on every bit of sig is discarded and below half: q = 0
        s_c = tl.minimum(s, 25)
        q = sig >> s_c
        rem = sig & ((1 << s_c) - 1)
        half = 1 << (s_c - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        q = q + up.to(tl.int32)
    carry = q >= (1 << (MANT + 1))
    q = tl.where(carry, q >> 1, q)
    big_e = tl.where(carry, big_e + 1, big_e)
    subnormal = (big_e == EMIN) & (q < (1 << MANT))
    normal_mag = ((big_e + BIAS) << MANT) | (q - (1 << MANT))
    mag = tl.where(q == 0, 0, tl.where(subnormal, q, normal_mag))
    sat = mag > MAX_BITS
    mag = tl.where(sat, MAX_BITS, mag)
    sign = (ybits >> 31).to(tl.int32)
    out = (sign << (WIDTH - 1)) | mag
    msign = (mbits >> 31).to(tl.int32)
    is_nan = (mbits & 0x7FFFFF) != 0
    special_mag = tl.where(is_nan | (INF_BITS < 0), NAN_BITS, INF_BITS)
    out = tl.where(special, (msign << (WIDTH - 1)) | special_mag, out)
    if WIDTH == 16:
        tl.store(dst + base + r, out.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(dst + base + r, out.to(tl.uint8), mask=mask)
    if EF:
        # The served number, exact in fp32: significand times a power of two built from its bits.
        is_sub = (mag >> MANT) == 0
        significand = tl.where(is_sub, mag, (mag & ((1 << MANT) - 1)) | (1 << MANT)).to(tl.float32)
        exponent = tl.where(is_sub, EMIN - MANT, (mag >> MANT) - BIAS - MANT)
        pow2 = ((exponent + 127) << 23).to(tl.uint32).to(tl.float32, bitcast=True)
        value = significand * pow2
        value = tl.where(sign == 1, -value, value)
        e = u - value * scale
        tl.store(new_residual + base + r, tl.where(special | sat | overflow | (e == 0), 0.0, e), mask=mask)
    _count(counts, special & mask, sat & ~special & mask, COUNT)


def _grid(n: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, LAUNCH["block"])),)


def launch_options() -> dict[str, object]:
    # No FMA: see the module's docstring.
    return {"num_warps": LAUNCH["num_warps"], "enable_fp_fusion": False}


def bf16_constexprs(stochastic: bool, ef: bool, count: bool = True) -> dict[str, object]:
    """The compile-time arguments of `_bf16_kernel` for one export (ef rounds to nearest)."""
    return {"STOCHASTIC": stochastic and not ef, "EF": ef, "BLOCK": LAUNCH["block"], "COUNT": count}


def float_constexprs(fmt: Format, scale_mode: int, stochastic: bool, ef: bool, cols: int) -> dict[str, object]:
    """The compile-time arguments of `_float_kernel` for one format, scale mode, rounding and row
    length (only whether it is a power of two, and which, matters: shifts instead of divisions)."""
    pow2 = scale_mode in (SCALE_ROW, SCALE_BLOCK) and cols > 0 and cols & (cols - 1) == 0
    return {
        "MANT": fmt.mantissa, "BIAS": fmt.bias, "EMIN": fmt.emin, "MAX_BITS": fmt.max_bits, "NAN_BITS": fmt.nan_bits,
        "INF_BITS": fmt.inf_bits, "WIDTH": fmt.width, "SCALE_MODE": scale_mode,
        "COLS_SHIFT": cols.bit_length() - 1 if pow2 else -1, "STOCHASTIC": stochastic, "EF": ef,
        "BLOCK": LAUNCH["block"], "COUNT": True,
    }


def bf16_export(
    master: torch.Tensor,
    served: torch.Tensor,
    k0: int,
    k1: int,
    offset: int,
    stochastic: bool,
    residual: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
    count: bool = True,
) -> torch.Tensor:
    """master float32 (1-D), served int16 view (1-D); ef when residuals are given (rtn). Returns the
    counters (non-finite, saturated) on the device: reading them waits for the kernel."""
    n = master.numel()
    counts = torch.zeros(2, dtype=torch.int64, device=master.device)
    ef = residual is not None
    dummy = master if not ef else residual
    _bf16_kernel[_grid(n)](master, served, dummy, new_residual if ef else dummy, counts, n, k0, k1, offset,
                           **bf16_constexprs(stochastic, ef, count), **launch_options())
    return counts


def bf16_runs_blocks(starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The programs of `_bf16_runs_kernel` for runs starts[j]:starts[j + 1] whose first elements
    are elements offsets[j] of their tensors: one row (start, end, first, run) per block of a run."""
    block = LAUNCH["block"]
    starts, offsets = np.asarray(starts, np.int64), np.asarray(offsets, np.int64)
    per_run = -(-np.diff(starts) // block)
    run = np.repeat(np.arange(per_run.size), per_run)
    within = (np.arange(run.size) - np.repeat(np.cumsum(per_run) - per_run, per_run)) * block
    return np.stack([starts[run] + within, starts[run + 1], offsets[run] + within, run], axis=1)


def bf16_runs_export(master: torch.Tensor, served: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor,
                     counts: torch.Tensor, stochastic: bool) -> None:
    """`_bf16_runs_kernel` over `blocks` (the rows of `bf16_runs_blocks`, int64 on the device, any
    shape): keys and counts are (runs, 2) int64 on the device; counts are added to, not read (no
    wait here)."""
    if n := blocks.numel() // 4:
        _bf16_runs_kernel[(n,)](master, served, blocks, keys, counts, STOCHASTIC=stochastic, BLOCK=LAUNCH["block"],
                                **launch_options())


def float_export(master: torch.Tensor, served: torch.Tensor, k0: int, k1: int, offset: int, stochastic: bool,
                 fmt: Format, scales: torch.Tensor, scale_mode: int, cols: int,
                 block_cols: int, residual: torch.Tensor | None = None,
                 new_residual: torch.Tensor | None = None) -> torch.Tensor:
    """Any format; served is an int16 (16-bit formats) or uint8 view. Returns the counters, as
    `bf16_export` does."""
    n = master.numel()
    counts = torch.zeros(2, dtype=torch.int64, device=master.device)
    ef = residual is not None
    dummy = master if not ef else residual
    _float_kernel[_grid(n)](
        master, served, dummy, new_residual if ef else dummy, scales, counts, n, k0, k1, offset,
        cols, block_cols, **float_constexprs(fmt, scale_mode, stochastic, ef, cols), **launch_options(),
    )
    return counts
