"""What an export is asked for (`ExportSpec`), what it counts (`ExportStats`), and the checks of a
kernel call's arguments, the same on every device."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from weightsvc.rounding._formats import DEFAULT_FP8_PATTERN, FORMATS, ROUNDINGS, SCALINGS, Format, Scales, check_choice
from weightsvc.rounding._keys import tensor_key


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

    def unscaled(self) -> ExportSpec:
        """The spec of a LoRA adapter's versions: the format asked for if it has no scales (bf16,
        fp16), else bf16. Engines load adapter weights as values (vLLM casts them to its LoRA dtype,
        PEFT to the module's): no loader takes scales, and at rank r an adapter is small."""
        return self if not FORMATS[self.format].scaled else dataclasses.replace(self, format="bf16")

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
