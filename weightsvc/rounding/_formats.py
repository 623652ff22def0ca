"""The served formats, described by the few numbers the kernels need."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 128  # fp8 block scales: 128 x 128 tiles (DeepSeek-V3 layout)
SCALINGS = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Format:
    name: str
    safetensors_dtype: str
    torch_dtype: str  # attribute of the torch module
    width: int  # bits of the encoding (8 or 16)
    mantissa: int  # explicit mantissa bits
    bias: int
    emin: int  # exponent of the smallest normal
    max_bits: int  # magnitude bits of the largest finite value
    max_value: float
    nan_bits: int  # magnitude bits of the canonical NaN
    inf_bits: int  # magnitude bits of Inf, or -1 when the format has none (Inf becomes NaN)
    scaled: bool  # fp8: values are divided by a per-tensor/channel/block scale first

    @property
    def itemsize(self) -> int:
        return self.width // 8


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("bf16", "BF16", "bfloat16", 16, 7, 127, -126, 0x7F7F, 3.3895313892515355e38, 0x7FC0, 0x7F80, False),
        Format("fp16", "F16", "float16", 16, 10, 15, -14, 0x7BFF, 65504.0, 0x7E00, 0x7C00, False),
        Format("fp8_e4m3", "F8_E4M3", "float8_e4m3fn", 8, 3, 7, -6, 0x7E, 448.0, 0x7F, -1, True),
        Format("fp8_e5m2", "F8_E5M2", "float8_e5m2", 8, 2, 15, -14, 0x7B, 57344.0, 0x7E, 0x7C, True),
    )
}
