"""Fair Cast: the one entry point that turns an fp32 master into its served copy.

The service, the CLI and learners all call `export` / `fair_cast`, so the served bits are the same
wherever they are computed (DESIGN §3). Functions here are pure: tensors in, tensors out, every key
explicit (seed, version, name, flat offset).

torch is imported only by the tensor functions: the service exports from numpy views and does not
pay torch's ~200 MiB of resident memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba
import numpy as np

from weightsvc.rounding._cpu import bf16_export
from weightsvc.rounding._keys import tensor_key

if TYPE_CHECKING:
    import torch

FORMATS = ("bf16",)
ROUNDINGS = ("rtn", "sr")
SERVED_DTYPE_NAMES = {"bf16": "bfloat16"}  # torch dtype attribute of each format

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "ExportSpec",
    "ExportStats",
    "check_choice",
    "export",
    "export_array",
    "fair_cast",
    "tensor_key",
    "use_threads",
]


def check_choice(kind: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; choose one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class ExportSpec:
    """How a model is exported: the target format, the rounding rule and the RNG seed."""

    format: str = "bf16"
    rounding: str = "sr"
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("format", self.format, FORMATS)
        check_choice("rounding", self.rounding, ROUNDINGS)
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed {self.seed} is outside [0, 2**64)")

    @property
    def served_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, SERVED_DTYPE_NAMES[self.format])  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ExportStats:
    nonfinite: int  # NaN/Inf elements in the master
    saturated: int  # finite elements clamped to the format's max


def use_threads(n: int) -> None:
    """Threads the CPU kernels may use when called from this thread.

    A server shares its cores with the network: a kernel that spreads over every core stalls at
    its barriers whenever the event loop takes one of them, so the service exports on one.
    """
    numba.set_num_threads(n)


def export_array(
    master: np.ndarray,
    out: np.ndarray,
    spec: ExportSpec,
    *,
    version: int,
    name: str,
    offset: int = 0,
) -> ExportStats:
    """Array form of `export`: `master` a 1-D float32 array (read-only is fine), `out` a writable
    1-D array of the served bytes (uint8 or a same-width integer view)."""
    if master.dtype != np.float32 or master.ndim != 1:
        raise TypeError(f"tensor {name!r}: master must be a 1-D float32 array, got {master.dtype}")
    served = out.view(np.uint16)
    if served.size != master.size:
        raise ValueError(f"tensor {name!r}: out holds {served.size} elements, master has {master.size}")
    k0, k1 = tensor_key(spec.seed, version, name)
    nonfinite, saturated = bf16_export(
        master.view(np.uint32),
        served,
        np.uint32(k0),
        np.uint32(k1),
        np.uint64(offset),
        spec.rounding == "sr",
    )
    return ExportStats(int(nonfinite), int(saturated))


def export(
    master: torch.Tensor,
    out: torch.Tensor,
    spec: ExportSpec,
    *,
    version: int,
    name: str,
    offset: int = 0,
) -> ExportStats:
    """Write the served copy of `master` into `out` (same number of elements, served dtype).

    `offset` is the flat index of master's first element within the whole tensor `name`, so a
    shard or a chunk exports to exactly the bits the whole tensor would.
    """
    import torch

    if master.dtype != torch.float32:
        raise TypeError(f"tensor {name!r}: master must be float32, got {master.dtype}")
    if master.device.type != "cpu" or out.device.type != "cpu":
        raise NotImplementedError(f"tensor {name!r}: only the CPU kernel exists so far")
    if out.dtype != spec.served_dtype or out.numel() != master.numel() or not out.is_contiguous():
        raise ValueError(f"tensor {name!r}: out must be a contiguous {spec.served_dtype} of {master.numel()} elements")
    return export_array(
        master.detach().contiguous().reshape(-1).numpy(),
        out.reshape(-1).view(torch.int16).numpy(),
        spec,
        version=version,
        name=name,
        offset=offset,
    )


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
    """The served copy of `master` (same shape), exactly as the service would serve it."""
    import torch

    spec = ExportSpec(format, rounding, seed)
    out = torch.empty(master.shape, dtype=spec.served_dtype)
    export(master, out, spec, version=version, name=name, offset=offset)
    return out
