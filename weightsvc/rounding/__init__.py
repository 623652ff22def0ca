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

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba
import numpy as np

from weightsvc.protocol.topology import fused_group
from weightsvc.rounding import _cpu
from weightsvc.rounding._codes import decode, pack, unpack
from weightsvc.rounding._formats import BLOCK, FORMATS, MICROSCALED, SCALINGS, Format, Scales
from weightsvc.rounding._keys import tensor_key
from weightsvc.rounding._microscale import (
    block_scale_values,
    block_scales,
    block_scales_torch,
    check_block_shape,
    nvfp4_global_scale,
    scales_from_block_amax,
)
from weightsvc.rounding._residual import Residual

if TYPE_CHECKING:
    import torch

ROUNDINGS = ("rtn", "sr", "sr-sticky", "ef")
# fp8 goes to 2-D weights; embeddings and norms stay in bf16 (their rows are looked up, not multiplied).
DEFAULT_FP8_PATTERN = r"^(?!.*(?:embed|norm)).*\.weight$"
SCALE_SUFFIX = "_scale_inv"  # fp8
BLOCK_SCALE_SUFFIX = "_scale"  # microscaled formats: the block scale codes
GLOBAL_SCALE_SUFFIX = "_global_scale"  # NVFP4
PACKED_SUFFIX = "_packed"  # FP4: two elements per byte
DEVICES = ("auto", "cpu", "cuda")

__all__ = [
    "BLOCK",
    "BLOCK_SCALE_SUFFIX",
    "DEFAULT_FP8_PATTERN",
    "DEVICES",
    "FORMATS",
    "GLOBAL_SCALE_SUFFIX",
    "MICROSCALED",
    "PACKED_SUFFIX",
    "ROUNDINGS",
    "SCALE_SUFFIX",
    "SCALINGS",
    "ExportSpec",
    "ExportStats",
    "Format",
    "Residual",
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
    "export_runs",
    "export_state_dict",
    "fair_cast",
    "fp8_scales",
    "fp8_scales_torch",
    "fused_group",
    "group_amax",
    "nvfp4_global_scale",
    "pack",
    "run_keys",
    "scales_from_block_amax",
    "served_scales",
    "served_tensors",
    "tensor_key",
    "unpack",
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
        """The format tensor `name` is served in: a scaled format (fp8, MX, NVFP4) for selected 2-D
        weights, else bf16. A tensor with tied aliases is scaled only if every one of its names
        selects it (a head tied to the embeddings stays bf16, as the embeddings do). Microscaled
        formats also need rows whose length is a multiple of their block (32 MX, 16 NVFP4)."""
        fmt = FORMATS[self.format]
        if fmt.scaled and not (len(shape) == 2 and all(re.search(self.fp8_pattern, n) for n in (name, *aliases))):
            return FORMATS["bf16"]
        if fmt.block and shape[1] % fmt.block:
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
    # A zero group gets 1; a tiny one at least the smallest normal, so its reciprocal stays finite.
    scale_inv[scale_inv == 0] = 1
    np.maximum(scale_inv, np.float32(2.0**-126), out=scale_inv)
    inverse = (np.float32(1) / scale_inv).astype(np.float32).reshape(-1)
    mode = {"tensor": _cpu.SCALE_TENSOR, "channel": _cpu.SCALE_ROW, "block": _cpu.SCALE_BLOCK}[scaling]
    return Scales(scale_inv, inverse, mode, cols, -(-cols // BLOCK))


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
    served bytes, uint8; `fmt.nbytes(master.size)` of them). `offset` is the flat index of
    master[0] within tensor `name`, so a chunk or a shard exports to exactly the bits of the whole
    tensor. `ef` reads `residual` and writes `new_residual` (both 1-D float32 like master; they may
    be the same array). Scaled formats take the whole tensor's `scales` (`fp8_scales`); packed
    (FP4) ones an even offset and size, so that a chunk starts and ends on a byte."""
    fmt = fmt or FORMATS[spec.format]
    check_export(master, out, spec, fmt, name=name, offset=offset, scales=scales, residual=residual,
                 new_residual=new_residual)
    # Packed formats: one code per byte from the kernel, packed two per byte below.
    served = np.empty(master.size, np.uint8) if fmt.packed else out.view(np.uint16 if fmt.width == 16 else np.uint8)
    ef = spec.rounding == "ef"
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
    )
    if fmt.packed:
        out.reshape(-1).view(np.uint8)[:] = pack(served)
    return ExportStats(int(nonfinite), int(saturated))


def check_export(
    master: np.ndarray, out: np.ndarray, spec: ExportSpec, fmt: Format, *, name: str, offset: int = 0,
    scales: Scales | None = None, residual: np.ndarray | None = None, new_residual: np.ndarray | None = None,
) -> None:
    """The rules of `export_array`'s arguments, on any device."""
    if master.dtype != np.float32 or master.ndim != 1:
        raise TypeError(f"tensor {name!r}: master must be a 1-D float32 array, got {master.dtype}")
    if out.nbytes != fmt.nbytes(master.size):
        raise ValueError(f"tensor {name!r}: out holds {out.nbytes} bytes, {master.size} elements of {fmt.name} "
                         f"take {fmt.nbytes(master.size)}")
    if fmt.packed and (offset % 2 or master.size % 2):
        raise ValueError(f"tensor {name!r}: {fmt.name} packs two elements per byte: offset {offset} and size "
                         f"{master.size} must be even")
    if fmt.scaled and scales is None:
        raise ValueError(f"tensor {name!r}: {fmt.name} needs scales (fp8_scales)")
    if fmt.scaled and scales is not None and (scales.codes is not None) != bool(fmt.block):
        raise ValueError(f"tensor {name!r}: {fmt.name} needs its own scales (fp8_scales with this format)")
    if spec.rounding == "ef" and (residual is None or new_residual is None):
        raise ValueError(f"tensor {name!r}: rounding 'ef' needs the residual")


def run_keys(master: np.ndarray, starts: np.ndarray, spec: ExportSpec, version: int, names: list[str],
             outs: np.ndarray) -> np.ndarray:
    """What `export_runs` takes, checked, on any device: the runs' keys, (runs, 2) uint32."""
    if spec.rounding == "ef" or spec.format != "bf16":
        raise ValueError(f"export_runs takes bf16 with rtn, sr or sr-sticky, not {spec.format} {spec.rounding}")
    if master.dtype != np.float32 or len(starts) != len(names) + 1 or len(outs) != len(names):
        raise ValueError("export_runs: master must be float32, with one start per run and one more")
    return np.array([spec.key(version, name) for name in names], np.uint32).reshape(-1, 2)


def export_runs(
    master: np.ndarray, starts: np.ndarray, served: np.ndarray, spec: ExportSpec, *, version: int,
    names: list[str], offsets: list[int], outs: np.ndarray,
) -> list[ExportStats]:
    """`export_array` of many small bf16 runs in one kernel call, the same bits as one call each
    (a call per small tensor costs more than its export). Run j: master[starts[j]:starts[j + 1]]
    (1-D float32), elements offsets[j]... of tensor names[j], exported to served[outs[j]:] (served:
    uint16, the whole data section). Rounding rtn, sr or sr-sticky; `ef` keeps a residual per
    tensor: one call each."""
    keys = run_keys(master, starts, spec, version, names, outs)
    counts = np.zeros((len(names), 2), np.int64)
    _cpu.bf16_export_runs(master.view(np.uint32), served, np.asarray(starts, np.int64), np.asarray(outs, np.int64),
                          np.array(offsets, np.uint64), keys[:, 0].copy(), keys[:, 1].copy(),
                          spec.stochastic, counts)
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
    group_amax: float | None = None,
) -> dict[str, torch.Tensor]:
    """The served tensors of one whole master tensor, named and shaped as `served_tensors` says:
    `{name: served}`, plus `{name}_scale_inv` for fp8, `{name}_scale` (and `{name}_global_scale`)
    for the microscaled formats. With `ef`, `residual` is read and updated for this tensor (after
    the whole export).

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
        scales = fp8_scales_torch(m if res_in is None else m + res_in.reshape(m.shape), fmt, spec.scaling,
                                  group_amax)
    layout = served_tensors(name, tuple(m.shape), fmt, spec.scaling)
    out = torch.empty(layout[0][1], dtype=_torch_dtype(fmt), device=m.device)
    if m.is_cuda:
        _export_triton(m, out, spec, fmt, version=version, name=name, scales=scales, residual=res_in,
                       new_residual=res_out)
    else:
        export_array(
            m.reshape(-1).numpy(), out.reshape(-1).view(torch.uint8).numpy(), spec, version=version, name=name,
            fmt=fmt, scales=scales, residual=None if res_in is None else res_in.numpy(),
            new_residual=None if res_out is None else res_out.numpy(),
        )
    if residual is not None and res_out is not None:
        residual.tensors[name] = res_out.cpu().numpy()
    served = {layout[0][0]: out}
    if scales is not None:
        for (scale_name, shape, dtype), array in zip(layout[1:], served_scales(scales, fmt), strict=True):
            t = torch.from_numpy(array.reshape(shape).copy())
            served[scale_name] = (t.view(torch.float8_e4m3fn) if dtype == "F8_E4M3" else t).to(m.device)
    return served


def served_tensors(
    name: str, shape: tuple[int, ...], fmt: Format, scaling: str = "block"
) -> list[tuple[str, tuple[int, ...], str]]:
    """The served tensors of master `name` of this shape in `fmt`, in order: (served name, shape,
    safetensors dtype). The one place that names them (the service, `export` and the loaders ask here):
    - unscaled: the tensor itself;
    - fp8: `{name}` and `{name}_scale_inv` (fp32 dequant multipliers, `scaling`'s layout: DeepSeek-V3's);
    - the microscaled formats, in the layout of compressed-tensors checkpoints, which vLLM loads
      (for `x.weight`: `x.weight_packed`, `x.weight_scale`, `x.weight_global_scale`):
      - mxfp8: `{name}` (float8_e4m3fn (N, K)) and `{name}_scale` (UE8M0 codes, uint8 (N, K / 32));
      - mxfp4: `{name}_packed` (E2M1 codes two per byte, element 2i in the low nibble: uint8
        (N, K / 2)) and `{name}_scale` (UE8M0, uint8 (N, K / 32));
      - nvfp4: `{name}_packed` (as mxfp4), `{name}_scale` (float8_e4m3fn (N, K / 16)) and
        `{name}_global_scale` (fp32 (1,); values are fp4 * scale / global scale)."""
    if not fmt.scaled:
        return [(name, shape, fmt.safetensors_dtype)]
    if not fmt.block:
        n, k = shape
        scale_shape = {"tensor": (), "channel": (n, 1)}.get(scaling, (-(-n // BLOCK), -(-k // BLOCK)))
        return [(name, shape, fmt.safetensors_dtype), (name + SCALE_SUFFIX, scale_shape, "F32")]
    n, k = check_block_shape(shape, fmt)
    elements = (name + PACKED_SUFFIX, (n, k // 2)) if fmt.packed else (name, (n, k))
    scale_dtype = "F8_E4M3" if fmt.scale_encoding == "e4m3" else "U8"
    out: list[tuple[str, tuple[int, ...], str]] = [
        (*elements, fmt.safetensors_dtype),
        (name + BLOCK_SCALE_SUFFIX, (n, k // fmt.block), scale_dtype),
    ]
    if fmt.global_scale:
        out.append((name + GLOBAL_SCALE_SUFFIX, (1,), "F32"))
    return out


def served_scales(scales: Scales, fmt: Format) -> list[np.ndarray]:
    """The arrays of a scaled tensor's served scale tensors, in `served_tensors`' order (flat)."""
    if not fmt.block:
        return [scales.scale_inv.reshape(-1)]
    assert scales.codes is not None
    arrays = [scales.codes.reshape(-1)]
    if fmt.global_scale:
        assert scales.global_scale is not None
        arrays.append(scales.global_scale.reshape(-1))
    return arrays


def group_amax(values: Iterable[np.ndarray]) -> float:
    """The max |finite value| over arrays (the masters, or m + e, of a fused group): exact."""
    top = np.float32(0)
    for v in values:  # (NaN/Inf left out in place: no copy of the finite elements)
        top = max(top, np.abs(v).max(initial=np.float32(0), where=np.isfinite(v)))
    return float(top)


def dequantize(
    served: Mapping[str, np.ndarray | torch.Tensor], name: str, fmt: Format, shape: tuple[int, ...],
    scaling: str = "block",
) -> np.ndarray:
    """The fp32 values of master `name` (of `shape`) served in `fmt`, from its served tensors as
    `served_tensors` names them: numpy arrays of any dtype (their bytes are read, as the service
    keeps them) or torch tensors on any device. Exactly the values the kernels' ef residual is
    taken against: element value times its block's fp32 multiplier, in fp32."""
    layout = served_tensors(name, shape, fmt, scaling)
    raw = [_bytes(served[entry[0]]) for entry in layout]
    codes = unpack(raw[0]) if fmt.packed else raw[0].view(np.uint16 if fmt.width == 16 else np.uint8)
    values = decode(codes, fmt)
    if not fmt.scaled:
        return values.reshape(shape)
    if not fmt.block:
        scale = raw[1].view(np.float32).reshape(layout[1][1])
        if scaling == "block":
            scale = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[: shape[0], : shape[1]]
        return (values.reshape(shape) * scale).astype(np.float32)
    n, k = shape
    gs = raw[2].view(np.float32) if fmt.global_scale else None
    scale = block_scale_values(raw[1].reshape(n, k // fmt.block), fmt, gs)
    return (values.reshape(n, k // fmt.block, fmt.block) * scale[..., None]).reshape(shape)


def _bytes(t: np.ndarray | torch.Tensor) -> np.ndarray:
    """The bytes of a numpy array or a torch tensor (any dtype, any device), flat uint8."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8)
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _export_triton(
    m: torch.Tensor, out: torch.Tensor, spec: ExportSpec, fmt: Format, *, version: int, name: str,
    scales: Scales | None, residual: torch.Tensor | None, new_residual: torch.Tensor | None,
) -> None:
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
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=m.device) if fmt.packed else served_bits
    _triton.float_export(
        flat, codes, k0, k1, 0, spec.stochastic, fmt,
        torch.from_numpy(scales.inverse).to(m.device) if scales else one,
        torch.from_numpy(scales.scale_inv.reshape(-1).copy()).to(m.device) if scales else one,
        scales.mode if scales else 0, scales.cols if scales else 1, scales.block_cols if scales else 1,
        residual, new_residual,
    )
    if fmt.packed:
        served_bits.copy_(pack(codes))


def export_state_dict(
    state_dict: dict[str, torch.Tensor],
    spec: ExportSpec,
    *,
    version: int,
    residual: Residual | None = None,
    device: str = "auto",
) -> dict[str, torch.Tensor]:
    """Exactly what the service serves for these masters at `version` (scales included).

    With `ef`, `residual` advances to `version` (pass the one of the previous version).
    """
    out: dict[str, torch.Tensor] = {}
    shared = _group_amaxes(state_dict, spec, residual)
    for name, master in state_dict.items():
        out.update(export(master, spec, version=version, name=name, residual=residual, device=device,
                          group_amax=shared.get(name)))
    if residual is not None:
        residual.version = version
    return out


def _group_amaxes(state_dict: Mapping[str, torch.Tensor], spec: ExportSpec,
                  residual: Residual | None) -> dict[str, float]:
    """NVFP4: the max |value| of each tensor's fused group (`fused_group`), which sets the group's
    shared global scale; of m + e with ef, as the export quantizes."""
    groups: dict[str, list[str]] = {}
    for name, master in state_dict.items():
        if spec.format_for(name, tuple(master.shape)).global_scale:
            groups.setdefault(fused_group(name), []).append(name)

    def values(name: str) -> np.ndarray:
        m = _master(state_dict[name], name).reshape(-1).numpy()
        return m if residual is None or spec.rounding != "ef" else m + residual.tensor(name, m.size)

    out = {}
    for members in groups.values():
        top = group_amax(values(n) for n in members)
        out.update(dict.fromkeys(members, top))
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
    )
    return out
