"""The torch-facing functions: whole tensors and state dicts in, their served tensors out, on the
device they live on; and the served tensors read back as values (`dequantize`).

torch is imported only inside these functions: the service exports from numpy views and does not
pay torch's ~200 MiB of resident memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from weightsvc.rounding._codes import decode, unpack
from weightsvc.rounding._export import export_array, export_device, export_tensor
from weightsvc.rounding._formats import BLOCK, FORMATS, Format
from weightsvc.rounding._layout import fused_group, served_scales, served_tensors
from weightsvc.rounding._microscale import block_scale_values
from weightsvc.rounding._residual import Residual
from weightsvc.rounding._scales import fp8_scales_torch, group_amax
from weightsvc.rounding._spec import ExportSpec

if TYPE_CHECKING:
    import torch


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
    aliases: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """The served tensors of one whole master tensor, named and shaped as `served_tensors` says:
    `{name: served}`, plus `{name}_scale_inv` for fp8, `{name}_scale` (and `{name}_global_scale`)
    for the microscaled formats. With `ef`, `residual` is read and updated for this tensor (after
    the whole export). `aliases`: the names tied to this tensor (they decide its format with it).

    `device`: "auto" exports where the master lives (Triton on CUDA, numba on the CPU), "cpu" or
    "cuda" force one (`export_device`); both give the same bits. The residual stays on the host, as
    the service keeps it."""
    import torch

    where = export_device(device, master.device.type)
    m = _master(master, name, master.device if device == "auto" else torch.device(
        "cuda" if where == "cuda" else "cpu"))
    fmt = spec.format_for(name, tuple(m.shape), aliases)
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
    if where == "cpu":
        export_array(
            m.reshape(-1).numpy(), out.reshape(-1).view(torch.uint8).numpy(), spec, version=version, name=name,
            fmt=fmt, scales=scales, residual=None if res_in is None else res_in.numpy(),
            new_residual=None if res_out is None else res_out.numpy(),
        )
    else:
        export_tensor(m.reshape(-1), out.reshape(-1).view(torch.uint8), spec, fmt, version=version, name=name,
                      scales=scales, residual=res_in, new_residual=res_out)
    if residual is not None and res_out is not None:
        residual.tensors[name] = res_out.cpu().numpy()
    served = {layout[0][0]: out}
    if scales is not None:
        for (scale_name, shape, dtype), array in zip(layout[1:], served_scales(scales, fmt), strict=True):
            t = torch.from_numpy(array.reshape(shape).copy())
            served[scale_name] = (t.view(torch.float8_e4m3fn) if dtype == "F8_E4M3" else t).to(m.device)
    return served


def export_state_dict(
    state_dict: dict[str, torch.Tensor],
    spec: ExportSpec,
    *,
    version: int,
    residual: Residual | None = None,
    device: str = "auto",
    aliases: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Exactly what the service serves for these masters at `version` (scales included).

    With `ef`, `residual` advances to `version` (pass the one of the previous version).
    `aliases` (alias -> tensor of `state_dict`, as a push declares ties): each alias is served as
    its tensor, the very same object, and decides the tensor's format with it.
    """
    tied: dict[str, tuple[str, ...]] = {}
    for alias, target in (aliases or {}).items():
        tied[target] = (*tied.get(target, ()), alias)
    out: dict[str, torch.Tensor] = {}
    shared = _group_amaxes(state_dict, spec, residual, tied)
    for name, master in state_dict.items():
        out.update(export(master, spec, version=version, name=name, residual=residual, device=device,
                          group_amax=shared.get(name), aliases=tied.get(name, ())))
    for alias, target in (aliases or {}).items():
        out[alias] = out[target]
    if residual is not None:
        residual.version = version
    return out


def _group_amaxes(state_dict: Mapping[str, torch.Tensor], spec: ExportSpec,
                  residual: Residual | None, tied: Mapping[str, tuple[str, ...]]) -> dict[str, float]:
    """NVFP4: the max |value| of each tensor's fused group (`fused_group`), which sets the group's
    shared global scale; of m + e with ef, as the export quantizes."""
    groups: dict[str, list[str]] = {}
    for name, master in state_dict.items():
        if spec.format_for(name, tuple(master.shape), tied.get(name, ())).global_scale:
            groups.setdefault(fused_group(name), []).append(name)

    def values(name: str) -> np.ndarray:
        m = _master(state_dict[name], name).reshape(-1).numpy()
        if residual is None or spec.rounding != "ef":
            return m
        with np.errstate(over="ignore"):  # m + e beyond the fp32 max: Inf, left out of the max
            return m + residual.tensor(name, m.size)

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
    (bf16/fp16, `rtn`/`sr`/`sr-sticky`), on the device the master is on (a GPU: the Triton
    kernel; the same bits). For fp8 and `ef`, use `export_state_dict`."""
    import torch

    spec = ExportSpec(format, rounding, seed)
    fmt = FORMATS[format]
    if fmt.scaled or rounding == "ef":
        raise ValueError("fair_cast covers unscaled formats without state; use export_state_dict for fp8 or ef")
    where = export_device("auto", master.device.type)
    m = _master(master, name, master.device)
    out = torch.empty(m.shape, dtype=_torch_dtype(fmt), device=m.device)
    if where == "cpu":
        export_array(
            m.reshape(-1).numpy(), out.reshape(-1).view(torch.uint8).numpy(), spec, version=version, name=name,
            fmt=fmt, offset=offset,
        )
    else:
        export_tensor(m.reshape(-1), out.reshape(-1).view(torch.uint8), spec, fmt, version=version, name=name,
                      offset=offset)
    return out


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
