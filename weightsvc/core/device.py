"""Where a push's export runs: the CPU kernels, or the Triton kernels on a GPU (`--device`).

Both take the same arguments as `rounding.export_array` (host arrays: the chunk as received, the
served bytes' slot in the version, the ef residuals the service keeps) and give the same bits, so
the staging code does not change with the device. On a GPU, each call copies the master (and the
residual) in, runs the kernel, and copies the served bytes (and the new residual) back; the bytes
the GPU holds meanwhile are reported (`weightsvc_gpu_staged_bytes`).

With `TRITON_INTERPRET=1` (Triton's own interpreter), `--device cuda` runs the same device code on
CPU tensors: that is how it is tested on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from weightsvc import rounding
from weightsvc.errors import FailedPrecondition, Unavailable

log = logging.getLogger("weightsvc.device")


def interpreted() -> bool:
    """Triton runs its kernels on the CPU (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cuda_visible() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install reads as no GPU
        return False


def _triton() -> object | None:
    try:
        from weightsvc.rounding import _triton

        return _triton
    except Exception:
        return None


@dataclass
class Kernels:
    """The export of one device. `name`: what the ready line and /readyz say (no spaces)."""

    name: str = "cpu"
    torch_device: str = ""  # "" for the CPU kernels; "cuda" (or "cpu" under the interpreter) for Triton
    staged: Callable[[int], None] = lambda n: None  # bytes the device holds for exports in progress
    failed: bool = False  # a GPU error happened: the service goes back to the CPU kernels

    @property
    def on_gpu(self) -> bool:
        return bool(self.torch_device)

    def export_array(self, master: np.ndarray, out: np.ndarray, spec: rounding.ExportSpec, *, version: int, name: str,
                     fmt: rounding.Format, offset: int = 0, scales: rounding.Scales | None = None,
                     residual: np.ndarray | None = None,
                     new_residual: np.ndarray | None = None) -> rounding.ExportStats:  # fmt: skip
        """`rounding.export_array` on this device: the same bits, the same rules (`check_export`)."""
        if not self.on_gpu:
            return rounding.export_array(master, out, spec, version=version, name=name, fmt=fmt, offset=offset,
                                         scales=scales, residual=residual, new_residual=new_residual)  # fmt: skip
        import torch

        from weightsvc.rounding import _triton

        rounding.check_export(master, out, spec, fmt, name=name, offset=offset, scales=scales, residual=residual,
                              new_residual=new_residual)  # fmt: skip
        ef = spec.rounding == "ef" and residual is not None
        with self._on_device(f"tensor {name!r}", master.nbytes * (3 if ef else 1) + out.nbytes):
            dev = torch.device(self.torch_device)
            m = torch.from_numpy(master).to(dev)
            bits = torch.empty(master.size, dtype=torch.int16 if fmt.width == 16 else torch.uint8, device=dev)
            res_in = torch.from_numpy(residual).to(dev) if ef else None
            res_out = torch.empty_like(m) if ef else None
            k0, k1 = spec.key(version, name)
            if fmt.name == "bf16":
                counts = _triton.bf16_export(m, bits, k0, k1, offset, spec.stochastic, res_in, res_out)
            else:
                sc = scales or rounding.Scales(np.ones(1, np.float32), np.ones(1, np.float32))
                counts = _triton.float_export(
                    m, bits, k0, k1, offset, spec.stochastic, fmt, torch.from_numpy(sc.inverse.reshape(-1)).to(dev),
                    torch.from_numpy(np.ascontiguousarray(sc.scale_inv.reshape(-1))).to(dev), sc.mode, sc.cols,
                    sc.block_cols, res_in, res_out,
                )  # fmt: skip
            if fmt.packed:  # the kernel writes one FP4 code per byte
                bits = rounding.pack(bits)
            # Straight into the version's slot (and the residual the service keeps): one copy each.
            torch.from_numpy(out.view(np.uint8)).copy_(bits.view(torch.uint8))
            if res_out is not None and new_residual is not None:
                torch.from_numpy(new_residual).copy_(res_out)
            return rounding.ExportStats(*counts)

    def export_runs(self, master: np.ndarray, starts: np.ndarray, served: np.ndarray, spec: rounding.ExportSpec, *,
                    version: int, names: list[str], offsets: list[int],
                    outs: np.ndarray) -> list[rounding.ExportStats]:  # fmt: skip
        """`rounding.export_runs` on this device. On a GPU the runs (small tensors) go in with one
        copy and come back with one; each is exported by its own kernel launch, with its own keys."""
        if not self.on_gpu:
            return rounding.export_runs(master, starts, served, spec, version=version, names=names, offsets=offsets,
                                        outs=outs)  # fmt: skip
        import torch

        from weightsvc.rounding import _triton

        with self._on_device(f"tensors {names[0]!r} and {len(names) - 1} more", master.nbytes * 3 // 2):
            m = torch.from_numpy(master).to(self.torch_device)
            bits = torch.empty(master.size, dtype=torch.int16, device=m.device)
            stats = []
            for j, run_name in enumerate(names):
                a, b = int(starts[j]), int(starts[j + 1])
                k0, k1 = spec.key(version, run_name)
                counts = _triton.bf16_export(m[a:b], bits[a:b], k0, k1, offsets[j], spec.stochastic)
                stats.append(rounding.ExportStats(*counts))
            codes = bits.cpu().numpy().view(np.uint16)
            for j in range(len(names)):
                a, b = int(starts[j]), int(starts[j + 1])
                served[int(outs[j]) : int(outs[j]) + b - a] = codes[a:b]
            return stats

    @contextlib.contextmanager
    def _on_device(self, what: str, nbytes: int) -> Iterator[None]:
        """An export on the GPU holding `nbytes` there meanwhile; any error in it refuses the push and
        sends the next ones to the CPU."""
        self.staged(nbytes)
        try:
            yield
        except Exception as e:
            self.failed = True
            raise Unavailable(f"{what}: the export on {self.name} failed ({type(e).__name__}: {e}); this push is "
                              "refused, the next ones export on the CPU") from e  # fmt: skip
        finally:
            self.staged(-nbytes)


def kernels_for(setting: str, staged: Callable[[int], None] = lambda n: None) -> Kernels:
    """The kernels `--device` asks for: `cpu`; `cuda` (refused with a clear error when no GPU is
    visible, or Triton is missing); `auto`: the GPU when one is visible, else the CPU."""
    gpu = cuda_visible()
    if setting == "cpu" or (setting == "auto" and not gpu):
        return Kernels("cpu", "", staged)
    if _triton() is None:
        if setting == "auto":
            log.warning("a GPU is visible, but Triton cannot be imported: exporting on the CPU")
            return Kernels("cpu", "", staged)
        raise FailedPrecondition("--device cuda: Triton cannot be imported (install the dev extra, Linux x86_64)")
    if gpu:
        import torch

        log.info("exporting on %s", torch.cuda.get_device_name())
        return Kernels(f"cuda:{torch.cuda.current_device()}", "cuda", staged)
    if interpreted():
        log.info("exporting with the Triton kernels on the CPU (TRITON_INTERPRET=1): for tests")
        return Kernels("cuda-interpreted", "cpu", staged)
    raise FailedPrecondition("--device cuda: torch sees no CUDA device (use --device cpu or auto)")
