"""Fair Cast: the one entry point that turns fp32 masters into their served copy.

The service, the `weightsvc export` command and learners all call these functions, so the served
bits are the same wherever they are computed. Functions are pure: arrays in, arrays out, every key
explicit (seed, version, tensor name, flat element offset); the EF residual is passed in and the
new one handed back, never kept here.

    served = fair_cast(master, format="bf16", rounding="sr", seed=0, version=step, name="w")
    out = export_state_dict(state_dict, ExportSpec("fp8_e4m3", "ef"), version=step, residual=res)

torch is imported only by the tensor functions: the service exports from numpy views and does not
pay torch's ~200 MiB of resident memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numba
import numpy as np

from weightsvc.rounding import _cpu
from weightsvc.rounding._formats import BLOCK, FORMATS, SCALINGS, Format
from weightsvc.rounding._keys import tensor_key
from weightsvc.rounding._residual import Residual

if TYPE_CHECKING:
    import torch

ROUNDINGS = ("rtn", "sr", "sr-sticky", "ef")
# fp8 goes to 2-D weights; embeddings and norms stay in bf16 (their rows are looked up, not multiplied).
DEFAULT_FP8_PATTERN = r"^(?!.*(?:embed|norm)).*\.weight$"
SCALE_SUFFIX = "_scale_inv"
DEVICES = ("auto", "cpu", "cuda")

__all__ = [
    "BLOCK",
    "DEFAULT_FP8_PATTERN",
    "DEVICES",
    "FORMATS",
    "ROUNDINGS",
    "SCALE_SUFFIX",
    "SCALINGS",
    "ExportSpec",
    "ExportStats",
    "Format",
    "Residual",
    "check_choice",
    "decode",
    "element_scales",
    "export",
    "export_array",
    "export_runs",
    "export_state_dict",
    "fair_cast",
    "fp8_scales",
    "fp8_scales_torch",
    "tensor_key",
    "use_threads",
]


def check_choice(kind: str, value: str, choices: Collection[str]) -> str:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; choose one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class ExportSpec:
    """How a model is exported: target format, rounding rule, RNG seed, and fp8 placement."""

    format: str = "bf16"
    rounding: str = "sr"
    seed: int = 0
    scaling: str = "block"  # fp8 scales: per tensor, per channel (row) or per 128x128 block
    fp8_pattern: str = DEFAULT_FP8_PATTERN

    def __post_init__(self) -> None:
        check_choice("format", self.format, FORMATS)
        check_choice("rounding", self.rounding, ROUNDINGS)
        check_choice("scaling", self.scaling, SCALINGS)
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed {self.seed} is outside [0, 2**64)")
        try:
            re.compile(self.fp8_pattern)
        except re.error as e:
            raise ValueError(f"fp8 pattern {self.fp8_pattern!r} is not a regular expression: {e}") from None

    def format_for(self, name: str, shape: tuple[int, ...], aliases: tuple[str, ...] = ()) -> Format:
        """The format tensor `name` is served in: fp8 for selected 2-D weights, else bf16. A tensor
        with tied aliases is fp8 only if every one of its names selects it (a head tied to the
        embeddings stays bf16, as the embeddings do)."""
        fmt = FORMATS[self.format]
        if fmt.scaled and not (len(shape) == 2 and all(re.search(self.fp8_pattern, n) for n in (name, *aliases))):
            return FORMATS["bf16"]
        return fmt

    def key(self, version: int, name: str) -> tuple[int, int]:
        # sr-sticky: the random threshold of each element does not change between versions.
        return tensor_key(self.seed, None if self.rounding == "sr-sticky" else version, name)

    @property
    def stochastic(self) -> bool:
        return self.rounding in ("sr", "sr-sticky")


@dataclass
class ExportStats:
    nonfinite: int = 0  # NaN/Inf elements in the master
    saturated: int = 0  # finite elements clamped to the format's max

    def add(self, other: ExportStats) -> None:
        self.nonfinite += other.nonfinite
        self.saturated += other.saturated


@dataclass(frozen=True)
class Scales:
    """fp8 scales of one 2-D tensor: the dequant multipliers (served) and their fp32 reciprocals."""

    scale_inv: np.ndarray  # DeepSeek-V3 layout: (), (N, 1) or (ceil(N/128), ceil(K/128)); fp32
    inverse: np.ndarray = field(repr=False)  # 1 / scale_inv, flat, fp32: what the kernels multiply by
    mode: int = _cpu.SCALE_NONE
    cols: int = 1
    block_cols: int = 1


def fp8_scales(values: np.ndarray, fmt: Format, scaling: str) -> Scales:
    """Scales of a 2-D float32 array: amax / format max per tensor, row or 128x128 block.

    An all-zero group (and a non-finite amax) gets scale 1, never a division by zero.
    """
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
    """The scales of groups with these (exact) maxima of |value|; shared by the CPU and CUDA paths."""
    scale_inv = np.array(np.asarray(amax, np.float32) / np.float32(fmt.max_value), dtype=np.float32)
    # A zero group gets 1; a tiny one at least the smallest normal, so its reciprocal stays finite.
    scale_inv[scale_inv == 0] = 1
    np.maximum(scale_inv, np.float32(2.0**-126), out=scale_inv)
    inverse = (np.float32(1) / scale_inv).astype(np.float32).reshape(-1)
    mode = {"tensor": _cpu.SCALE_TENSOR, "channel": _cpu.SCALE_ROW, "block": _cpu.SCALE_BLOCK}[scaling]
    return Scales(scale_inv, inverse, mode, cols, -(-cols // BLOCK))


def fp8_scales_torch(values: torch.Tensor, fmt: Format, scaling: str) -> Scales:
    """fp8_scales for a torch tensor on any device: the maxima where the values are (exact, so equal
    to the numpy path's), the small rest on the host."""
    import torch

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


_DECODE_TABLES: dict[str, np.ndarray] = {}


def decode(codes: np.ndarray, fmt: Format) -> np.ndarray:
    """The float32 values of served codes (before any fp8 scale): for metrics, not the hot path."""
    if fmt.name == "bf16":
        return (codes.astype(np.uint32) << 16).view(np.float32)
    if fmt.name == "fp16":
        return codes.astype(np.uint16).view(np.float16).astype(np.float32)
    table = _DECODE_TABLES.get(fmt.name)
    if table is None:
        table = np.empty(256, np.float32)
        for code in range(256):
            mag, exp = code & 0x7F, (code & 0x7F) >> fmt.mantissa
            mant = mag & ((1 << fmt.mantissa) - 1)
            if mag == fmt.inf_bits:
                value = math.inf
            elif mag > fmt.max_bits:
                value = math.nan
            elif exp == 0:
                value = math.ldexp(mant, fmt.emin - fmt.mantissa)
            else:
                value = math.ldexp(mant | 1 << fmt.mantissa, exp - fmt.bias - fmt.mantissa)
            table[code] = -value if code & 0x80 else value
        _DECODE_TABLES[fmt.name] = table
    return table[codes.astype(np.uint8)]


def element_scales(scales: Scales, indices: np.ndarray) -> np.ndarray:
    """The dequant multiplier of each flat element index of a scaled tensor."""
    flat = scales.scale_inv.reshape(-1)
    if scales.mode == _cpu.SCALE_TENSOR:
        return np.broadcast_to(flat[0], indices.shape)
    rows = indices // scales.cols
    if scales.mode == _cpu.SCALE_ROW:
        return flat[rows]
    return flat[(rows // BLOCK) * scales.block_cols + (indices - rows * scales.cols) // BLOCK]


def use_threads(n: int) -> None:
    """Threads the CPU kernels may use when called from this thread.

    A server shares its cores with the network: a kernel that spreads over every core stalls at
    its barriers whenever the event loop takes one of them, so the service exports on one.
    """
    numba.set_num_threads(n)


_NO_SCALES = np.ones(1, np.float32)
_NO_RESIDUAL = np.zeros(0, np.float32)


def export_array(
    master: np.ndarray,
    out: np.ndarray,
    spec: ExportSpec,
    *,
    version: int,
    name: str,
    fmt: Format | None = None,
    offset: int = 0,
    scales: Scales | None = None,
    residual: np.ndarray | None = None,
    new_residual: np.ndarray | None = None,
) -> ExportStats:
    """The kernel entry point: export `master` (1-D float32, read-only is fine) into `out` (the
    served bytes, uint8). `offset` is the flat index of master[0] within tensor `name`, so a chunk
    or a shard exports to exactly the bits of the whole tensor. `ef` reads `residual` and writes
    `new_residual` (both 1-D float32 like master; they may be the same array)."""
    fmt = fmt or FORMATS[spec.format]
    if master.dtype != np.float32 or master.ndim != 1:
        raise TypeError(f"tensor {name!r}: master must be a 1-D float32 array, got {master.dtype}")
    served = out.view(np.uint16 if fmt.width == 16 else np.uint8)
    if served.size != master.size:
        raise ValueError(f"tensor {name!r}: out holds {served.size} elements, master has {master.size}")
    if fmt.scaled and scales is None:
        raise ValueError(f"tensor {name!r}: {fmt.name} needs scales (fp8_scales)")
    ef = spec.rounding == "ef"
    if ef and (residual is None or new_residual is None):
        raise ValueError(f"tensor {name!r}: rounding 'ef' needs the residual")
    if ef and fmt.name == "bf16":
        nonfinite, saturated = _cpu.bf16_export_ef(master, served, residual, new_residual)
        return ExportStats(int(nonfinite), int(saturated))
    k0, k1 = spec.key(version, name)
    if fmt.name == "bf16":
        nonfinite, saturated = _cpu.bf16_export(
            master.view(np.uint32), served, np.uint32(k0), np.uint32(k1), np.uint64(offset), spec.stochastic
        )
        return ExportStats(int(nonfinite), int(saturated))
    sc = scales or Scales(_NO_SCALES, _NO_SCALES)
    nonfinite, saturated = _cpu.float_export(
        master, served, np.uint32(k0), np.uint32(k1), np.uint64(offset), spec.stochastic,
        fmt.mantissa, fmt.bias, fmt.emin, fmt.max_bits, fmt.nan_bits, fmt.inf_bits, fmt.width,
        sc.inverse, sc.scale_inv.reshape(-1), sc.mode, sc.cols, sc.block_cols,
        residual if ef else _NO_RESIDUAL, new_residual if ef else _NO_RESIDUAL, ef,
    )  # fmt: skip
    return ExportStats(int(nonfinite), int(saturated))


def export_runs(
    master: np.ndarray, starts: np.ndarray, served: np.ndarray, spec: ExportSpec, *, version: int,
    names: list[str], offsets: list[int], outs: np.ndarray,
) -> list[ExportStats]:
    """`export_array` of many small bf16 runs in one kernel call, the same bits as one call each
    (a call per small tensor costs more than its export). Run j: master[starts[j]:starts[j + 1]]
    (1-D float32), elements offsets[j]... of tensor names[j], exported to served[outs[j]:] (served:
    uint16, the whole data section). Rounding rtn, sr or sr-sticky; `ef` keeps a residual per
    tensor: one call each."""
    if spec.rounding == "ef" or spec.format != "bf16":
        raise ValueError(f"export_runs takes bf16 with rtn, sr or sr-sticky, not {spec.format} {spec.rounding}")
    if master.dtype != np.float32 or len(starts) != len(names) + 1 or len(outs) != len(names):
        raise ValueError("export_runs: master must be float32, with one start per run and one more")
    keys = np.array([spec.key(version, name) for name in names], np.uint32).reshape(-1, 2)
    counts = np.zeros((len(names), 2), np.int64)
    _cpu.bf16_export_runs(master.view(np.uint32), served, np.asarray(starts, np.int64), np.asarray(outs, np.int64),
                          np.array(offsets, np.uint64), keys[:, 0].copy(), keys[:, 1].copy(),
                          spec.stochastic, counts)  # fmt: skip
    return [ExportStats(int(nf), int(sat)) for nf, sat in counts.tolist()]


def _master(master: torch.Tensor, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 on `device`, contiguous; bf16/fp16 widen exactly, anything else is refused."""
    import torch

    if master.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"tensor {name!r}: master must be float32 (bf16/fp16 widen exactly), got {master.dtype}")
    return master.detach().to(device, torch.float32).contiguous()


def _torch_dtype(fmt: Format) -> torch.dtype:
    import torch

    return getattr(torch, fmt.torch_dtype)  # type: ignore[no-any-return]


def export(
    master: torch.Tensor,
    spec: ExportSpec,
    *,
    version: int,
    name: str,
    residual: Residual | None = None,
    device: str = "auto",
) -> dict[str, torch.Tensor]:
    """The served tensors of one whole master tensor: `{name: served}`, plus `{name}_scale_inv`
    for fp8. With `ef`, `residual` is read and updated for this tensor (after the whole export).

    `device`: "auto" exports where the master lives (Triton on CUDA, numba on the CPU), "cpu" or
    "cuda" force one; both give the same bits. The residual stays on the host, as the service keeps it."""
    import torch

    check_choice("device", device, DEVICES)
    m = _master(master, name, master.device if device == "auto" else torch.device(device))
    fmt = spec.format_for(name, tuple(m.shape))
    res_in = res_out = None
    if spec.rounding == "ef":
        if residual is None:
            raise ValueError(f"tensor {name!r}: rounding 'ef' needs a Residual")
        res_in = torch.from_numpy(residual.tensor(name, m.numel())).to(m.device)
        res_out = torch.empty_like(res_in)
    scales = None
    if fmt.scaled:
        scales = fp8_scales_torch(m if res_in is None else m + res_in.reshape(m.shape), fmt, spec.scaling)
    out = torch.empty(m.shape, dtype=_torch_dtype(fmt), device=m.device)
    if m.is_cuda:
        _export_triton(m, out, spec, fmt, version=version, name=name, scales=scales, residual=res_in,
                       new_residual=res_out)  # fmt: skip
    else:
        export_array(
            m.reshape(-1).numpy(), out.reshape(-1).view(torch.uint8).numpy(), spec, version=version, name=name,
            fmt=fmt, scales=scales, residual=None if res_in is None else res_in.numpy(),
            new_residual=None if res_out is None else res_out.numpy(),
        )  # fmt: skip
    if residual is not None and res_out is not None:
        residual.tensors[name] = res_out.cpu().numpy()
    served = {name: out}
    if scales is not None:
        served[name + SCALE_SUFFIX] = torch.from_numpy(scales.scale_inv.copy()).to(m.device)
    return served


def _export_triton(
    m: torch.Tensor, out: torch.Tensor, spec: ExportSpec, fmt: Format, *, version: int, name: str,
    scales: Scales | None, residual: torch.Tensor | None, new_residual: torch.Tensor | None,
) -> None:  # fmt: skip
    """The CUDA side of `export`: the Triton kernels, with the keys and scales of the CPU path."""
    import torch

    from weightsvc.rounding import _triton

    k0, k1 = spec.key(version, name)
    flat = m.reshape(-1)
    served_bits = out.reshape(-1).view(torch.int16 if fmt.width == 16 else torch.uint8)
    if fmt.name == "bf16":
        _triton.bf16_export(flat, served_bits, k0, k1, 0, spec.stochastic, residual, new_residual)
        return
    one = torch.ones(1, device=m.device)
    _triton.float_export(
        flat, served_bits, k0, k1, 0, spec.stochastic, fmt,
        torch.from_numpy(scales.inverse).to(m.device) if scales else one,
        torch.from_numpy(scales.scale_inv.reshape(-1).copy()).to(m.device) if scales else one,
        scales.mode if scales else 0, scales.cols if scales else 1, scales.block_cols if scales else 1,
        residual, new_residual,
    )  # fmt: skip


def export_state_dict(
    state_dict: dict[str, torch.Tensor],
    spec: ExportSpec,
    *,
    version: int,
    residual: Residual | None = None,
    device: str = "auto",
) -> dict[str, torch.Tensor]:
    """Exactly what the service serves for these masters at `version` (fp8 scales included).

    With `ef`, `residual` advances to `version` (pass the one of the previous version).
    """
    out: dict[str, torch.Tensor] = {}
    for name, master in state_dict.items():
        out.update(export(master, spec, version=version, name=name, residual=residual, device=device))
    if residual is not None:
        residual.version = version
    return out


def fair_cast(
    master: torch.Tensor,
    *,
    format: str = "bf16",
    rounding: str = "sr",
    seed: int = 0,
    version: int,
    name: str,
    offset: int = 0,
) -> torch.Tensor:
    """The served copy of one master tensor or of a flat shard of it starting at element `offset`
    (bf16/fp16, `rtn`/`sr`/`sr-sticky`). For fp8 and `ef`, use `export_state_dict`."""
    import torch

    spec = ExportSpec(format, rounding, seed)
    fmt = FORMATS[format]
    if fmt.scaled or rounding == "ef":
        raise ValueError("fair_cast covers unscaled formats without state; use export_state_dict for fp8 or ef")
    m = _master(master, name)
    out = torch.empty(m.shape, dtype=_torch_dtype(fmt))
    export_array(
        m.reshape(-1).numpy(), out.reshape(-1).view(torch.uint8).numpy(), spec, version=version, name=name,
        fmt=fmt, offset=offset,
    )  # fmt: skip
    return out
