"""The vocabulary of the export: the served formats and their scales (described by the few numbers
the kernels need), the roundings, scalings and devices. Imports no kernel: the settings and the
command line check a choice against these without loading numba."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

BLOCK = 128  # fp8 block scales: 128 x 128 tiles (DeepSeek-V3 layout)
SCALINGS = ("tensor", "channel", "block")
ROUNDINGS = ("rtn", "sr", "sr-sticky", "ef")
DEVICES = ("auto", "cpu", "cuda")
# fp8 goes to 2-D weights; embeddings and norms stay in bf16 (their rows are looked up, not multiplied).
DEFAULT_FP8_PATTERN = r"^(?!.*(?:embed|norm)).*\.weight$"
# How the kernels find the scale of flat element g: none, one, g // cols, or a 128 x 128 tile.
SCALE_NONE, SCALE_TENSOR, SCALE_ROW, SCALE_BLOCK = 0, 1, 2, 3


@dataclass(frozen=True)
class Format:
    name: str
    safetensors_dtype: str
    torch_dtype: str  # attribute of the torch module
    width: int  # bits of the encoding (4, 8 or 16)
    mantissa: int  # explicit mantissa bits
    bias: int
    emin: int  # exponent of the smallest normal
    max_bits: int  # magnitude bits of the largest finite value
    max_value: float
    # Magnitude bits NaN and Inf become. -1 for inf_bits: no Inf (Inf becomes NaN). A format
    # without either (E2M1, `specials=False`) serves NaN as +-0 and Inf as +-max.
    nan_bits: int
    inf_bits: int
    scaled: bool  # the scales need the whole tensor: values are divided by a scale first
    block: int = 0  # microscaling: elements per scale along the row (32 MX, 16 NVFP4); 0: none
    packed: bool = False  # two 4-bit elements per byte
    scale_encoding: str = ""  # the served block scales: "ue8m0" (power of two) or "e4m3"; "": fp32
    global_scale: bool = False  # one fp32 scale per tensor besides the block scales (NVFP4)
    specials: bool = True  # the format encodes NaN

    @property
    def itemsize(self) -> int:
        """Bytes per element; packed formats have none (see `nbytes`)."""
        if self.packed:
            raise ValueError(f"{self.name} packs two elements per byte: use Format.nbytes")
        return self.width // 8

    def nbytes(self, numel: int) -> int:
        """Bytes of `numel` served elements."""
        return numel * self.width // 8


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("bf16", "BF16", "bfloat16", 16, 7, 127, -126, 0x7F7F, 3.3895313892515355e38, 0x7FC0, 0x7F80, False),
        Format("fp16", "F16", "float16", 16, 10, 15, -14, 0x7BFF, 65504.0, 0x7E00, 0x7C00, False),
        Format("fp8_e4m3", "F8_E4M3", "float8_e4m3fn", 8, 3, 7, -6, 0x7E, 448.0, 0x7F, -1, True),
        Format("fp8_e5m2", "F8_E5M2", "float8_e5m2", 8, 2, 15, -14, 0x7B, 57344.0, 0x7E, 0x7C, True),
        Format("mxfp8", "F8_E4M3", "float8_e4m3fn", 8, 3, 7, -6, 0x7E, 448.0, 0x7F, -1, True, block=32,
               scale_encoding="ue8m0"),
        # E2M1 has neither NaN nor Inf: NaN serves +-0, Inf +-6 (both counted as non-finite).
        Format("nvfp4", "U8", "uint8", 4, 1, 1, 0, 0x7, 6.0, 0x0, 0x7, True, block=16, packed=True,
               scale_encoding="e4m3", global_scale=True, specials=False),
        Format("mxfp4", "U8", "uint8", 4, 1, 1, 0, 0x7, 6.0, 0x0, 0x7, True, block=32, packed=True,
               scale_encoding="ue8m0", specials=False),
    )
}
MICROSCALED = tuple(name for name, f in FORMATS.items() if f.block)


@dataclass(frozen=True)
class Scales:
    """The scales of one 2-D tensor: the dequant multipliers, which the kernels divide by.

    fp8: `scale_inv` is served as is (`<name>_scale_inv`). Microscaled formats: `scale_inv` holds
    the effective fp32 dequant multiplier of each block, (N, K / block); what is served is `codes`
    (and `global_scale` for NVFP4). A block of a row is then a "row" of `block` flat elements
    (K % block == 0), so the kernels use their per-row mode with `cols = block`.
    """

    scale_inv: np.ndarray  # DeepSeek-V3 layout: (), (N, 1) or (ceil(N/128), ceil(K/128)); fp32
    mode: int = SCALE_NONE
    cols: int = 1
    block_cols: int = 1
    codes: np.ndarray | None = None  # microscaled: the served block scales, uint8 (N, K / block)
    global_scale: np.ndarray | None = None  # NVFP4: the served fp32 global scale, shape (1,)


def check_choice(kind: str, value: str, choices: Collection[str]) -> str:
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; choose one of {', '.join(choices)}")
    return value
