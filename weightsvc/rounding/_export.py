"""The kernel calls: the numba kernels on the host, the Triton kernels on a GPU (or on Triton's
interpreter), and which of them an export runs on. numba and Triton load when a kernel first runs,
not when the package is imported."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from weightsvc.errors import FailedPrecondition
from weightsvc.rounding._codes import pack
from weightsvc.rounding._formats import DEVICES, FORMATS, Format, Scales, check_choice
from weightsvc.rounding._spec import ExportSpec, ExportStats, check_export, run_keys

if TYPE_CHECKING:
    import torch

log = logging.getLogger("weightsvc.device")

_NO_SCALES = np.ones(1, np.float32)
_NO_RESIDUAL = np.zeros(0, np.float32)


def use_threads(n: int) -> None:
    """Threads the CPU kernels may use when called from this thread.

    A server shares its cores with the network: a kernel that spreads over every core stalls at
    its barriers whenever the event loop takes one of them, so the service exports on one.
    """
    import numba

    numba.set_num_threads(n)


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
    from weightsvc.rounding import _cpu

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
        args = (np.uint32(k0), np.uint32(k1), np.uint64(offset), spec.stochastic)
        if _cpu.bf16_export(master.view(np.uint32), served, *args) < _cpu.BF16_EXTREME:
            return ExportStats(0, 0)
        nonfinite, saturated = _cpu.bf16_counts(master.view(np.uint32), *args)
        return ExportStats(int(nonfinite), int(saturated))
    sc = scales or Scales(_NO_SCALES)
    nonfinite, saturated = _cpu.float_export(
        master, served, np.uint32(k0), np.uint32(k1), np.uint64(offset), spec.stochastic,
        fmt.mantissa, fmt.bias, fmt.emin, fmt.max_bits, fmt.nan_bits, fmt.inf_bits, fmt.width,
        sc.scale_inv.reshape(-1), sc.mode, sc.cols, sc.block_cols,
        residual if ef else _NO_RESIDUAL, new_residual if ef else _NO_RESIDUAL, ef,
    )
    if fmt.packed:
        out.reshape(-1).view(np.uint8)[:] = pack(served)
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
    from weightsvc.rounding import _cpu

    keys = run_keys(master, starts, spec, version, names, outs)
    counts = np.zeros((len(names), 2), np.int64)
    _cpu.bf16_export_runs(master.view(np.uint32), served, np.asarray(starts, np.int64), np.asarray(outs, np.int64),
                          np.array(offsets, np.uint64), keys[:, 0].copy(), keys[:, 1].copy(),
                          spec.stochastic, counts)
    return [ExportStats(int(nf), int(sat)) for nf, sat in counts.tolist()]


def export_tensor(
    master: torch.Tensor, served: torch.Tensor, spec: ExportSpec, fmt: Format, *, version: int, name: str,
    offset: int = 0, scales: Scales | None = None, residual: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`export_array` with the Triton kernels, on the device the tensors are on (a GPU, or the CPU
    under Triton's interpreter), with the keys and scales of the CPU path: the same bits. `master`:
    flat float32; `served`: the served bytes, flat uint8 (`fmt.nbytes(master.numel())`); with ef the
    residuals, flat float32. Returns the counters (non-finite, saturated), int64 on the device:
    reading them waits for the kernel."""
    import torch

    from weightsvc.rounding import _triton

    k0, k1 = spec.key(version, name)
    bits = served.view(torch.int16) if fmt.width == 16 else served
    if fmt.name == "bf16":
        return _triton.bf16_export(master, bits, k0, k1, offset, spec.stochastic, residual, new_residual)
    sc = scales or Scales(_NO_SCALES)
    # Packed formats: the kernel writes one FP4 code per byte, packed two per byte below.
    codes = torch.empty(master.numel(), dtype=torch.uint8, device=master.device) if fmt.packed else bits
    counts = _triton.float_export(
        master, codes, k0, k1, offset, spec.stochastic, fmt, _on(sc.scale_inv, master.device), sc.mode, sc.cols,
        sc.block_cols, residual, new_residual,
    )
    if fmt.packed:
        bits.copy_(pack(codes))
    return counts


def export_runs_tensor(master: torch.Tensor, served: torch.Tensor, spec: ExportSpec, *, starts: np.ndarray,
                       offsets: list[int], keys: np.ndarray) -> torch.Tensor:
    """`export_runs` with the Triton kernel, all the runs in one launch: `master` the runs' elements
    (flat float32 on the device, run j from starts[j]), `served` their codes at the same places
    (int16), `keys` the runs' (`run_keys`). Returns the counters of each run, (runs, 2) int64 on the
    device: reading them waits for the kernel."""
    import torch

    from weightsvc.rounding import _triton

    blocks = _triton.bf16_runs_blocks(starts, np.asarray(offsets, np.int64))
    counts = torch.zeros((len(keys), 2), dtype=torch.int64, device=master.device)
    _triton.bf16_runs_export(master, served, _on(blocks, master.device), _on(keys.astype(np.int64), master.device),
                             counts, spec.stochastic)
    return counts


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    import torch

    return torch.from_numpy(np.ascontiguousarray(a.reshape(-1))).to(device)


def interpreted() -> bool:
    """Triton runs its kernels on the CPU (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Device nodes of a GPU driver (NVIDIA; AMD's for ROCm builds of torch). Without one, torch cannot see
# a GPU: asking it would only import it, 250 MiB of the server's memory for nothing.
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def cuda_visible() -> bool:
    if not any(os.path.exists(node) for node in _GPU_NODES):
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install reads as no GPU
        return False


def _triton_imports() -> bool:
    try:
        from weightsvc.rounding import _triton  # noqa: F401
    except Exception:
        return False
    return True


def export_device(setting: str, master: str | None = None) -> str:
    """Where an export runs under a device setting (one of `DEVICES`): "cpu" (the numba kernels),
    "cuda" (the Triton kernels on a GPU) or "interpreted" (the Triton kernels on CPU tensors, under
    `TRITON_INTERPRET=1`: tests). `auto` exports where the master lives (`master`: its device type);
    a master on the host (None: the service's chunks) on the GPU when one is visible and Triton
    imports, else on the CPU. `cuda` is refused with a clear error when it cannot run."""
    check_choice("device", setting, DEVICES)
    if setting == "cpu" or (setting == "auto" and master == "cpu"):
        return "cpu"
    if setting == "auto" and master is not None:
        return "cuda"
    gpu = cuda_visible()
    if setting == "auto" and not gpu:
        return "cpu"
    if not _triton_imports():
        if setting == "auto":
            log.warning("a GPU is visible, but Triton cannot be imported: exporting on the CPU")
            return "cpu"
        raise FailedPrecondition("--device cuda: Triton cannot be imported (install the dev extra, Linux x86_64)")
    if gpu:
        return "cuda"
    if interpreted():
        return "interpreted"
    raise FailedPrecondition("--device cuda: torch sees no CUDA device (use --device cpu or auto)")
