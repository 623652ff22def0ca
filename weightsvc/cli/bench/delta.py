"""delta: how many bytes a delta pull moves against a dense one, per rounding mode."""

from __future__ import annotations

import torch


def delta_bench(*, size_mib: int = 64, lr: float = 3e-6) -> dict[str, float]:
    """delta_ratio_<mode>: delta bytes / dense bytes between two versions one Adam-sized step apart
    (every element moves by lr, as in the demo), in mid-training: masters off the bf16 grid."""
    from weightsvc import rounding
    from weightsvc.protocol.delta import encode
    from weightsvc.protocol.manifest import Manifest, layout

    gen = torch.Generator().manual_seed(0)
    shape = ((size_mib << 20) // 4 // 2048, 2048)
    m0 = torch.randn(shape, generator=gen) * 0.02
    m1 = m0 + lr * torch.sign(torch.randn(shape, generator=gen))
    out: dict[str, float] = {}
    for mode in rounding.ROUNDINGS:
        spec, residual = rounding.ExportSpec("bf16", mode), rounding.Residual()
        served = [rounding.export_state_dict({"w": m}, spec, version=v, residual=residual)["w"]
                  for v, m in ((1, m0), (2, m1))]
        slots, nbytes = layout([("w", shape, "BF16")])
        manifest = Manifest("bench", 2, "bf16", mode, 0, 0.0, nbytes, "", tuple(slots))
        data = [t.view(torch.uint8).reshape(-1).numpy().data for t in served]
        out[f"delta_ratio_{mode}"] = round(len(encode(manifest, data[1], data[0])) / nbytes, 4)
    return out
