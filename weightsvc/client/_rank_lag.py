"""The learner's half of a published version's lag: a rank holds both its rows' masters and their served
copy, so it measures them as the service measures a push (`protocol.lag`), on the same sampled elements
(every stride-th flat element of each tensor, the stride from the whole model's size), and sends the
sums; the service adds the ranks' sums up and records the figures as a push's.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsvc import rounding
from weightsvc.protocol.lag import LagRows, LagSums, Sample, sample_stride, sampled_indices
from weightsvc.rounding import ExportSpec

# A tensor as the rank holds it: (its data, the flat offset of its first element, the whole tensor's
# shape); the shape None: the tensor itself, whole.
Held = tuple[Any, int, "tuple[int, ...] | None"]


@dataclass
class RankLag:
    """A learner rank's lag state across the versions it publishes of one model: the samples of its rows
    at the run's first version, at the previous one and at the visibility windows' anchors. Keep one per
    rank and model for the whole run and pass it with every publish; it advances only when the version
    commits, so a refused publish can be made again. A fresh one starts a new run (the figures are then
    measured from its first version)."""

    rows: LagRows = field(default_factory=LagRows)


def _numpy(data: Any, idx: np.ndarray | None = None) -> np.ndarray:
    """A master's flat values as fp32 numpy (on the host), all of them or those at `idx`."""
    if isinstance(data, np.ndarray):
        flat = data.reshape(-1)
        return flat if idx is None else flat[idx]
    torch = sys.modules["torch"]
    flat = data.detach().reshape(-1)
    if idx is not None:
        flat = flat[torch.from_numpy(idx).to(flat.device)]
    return flat.to("cpu", torch.float32).numpy()  # type: ignore[no-any-return]  # (bf16 and fp16 widen exactly)


def _codes(data: Any, fmt: rounding.Format) -> np.ndarray:
    """The served element codes of a served tensor's bytes (flat; a packed format unpacked)."""
    if isinstance(data, np.ndarray):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        torch = sys.modules["torch"]
        raw = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if fmt.packed:
        return rounding.unpack(raw)
    return raw.view(np.uint16 if fmt.width == 16 else np.uint8)


def _saturated(codes: np.ndarray, values: np.ndarray, master: Any, fmt: rounding.Format) -> int:
    """Elements served at the format's largest magnitude from a finite master beyond it. (The export
    counts the elements whose rounding went past the range; those are these, but for a master within
    an ulp beyond the range that the export rounded down to the largest value.)"""
    at_max = np.flatnonzero((codes & ((1 << (fmt.width - 1)) - 1)) == fmt.max_bits)
    if not at_max.size:
        return 0
    m = _numpy(master, at_max).astype(np.float64)
    return int(np.count_nonzero(np.isfinite(m) & (np.abs(m) > np.abs(values[at_max].astype(np.float64)))))


def _rows(held: Held) -> tuple[Any, int, int]:
    """(data, flat offset, element count) of a tensor or a rank's part of it."""
    data, offset, shape = held
    count = int(data.size if isinstance(data, np.ndarray) else data.numel())
    return data, offset if shape is not None else 0, count


def rank_sample(masters: Mapping[str, Held], served: Mapping[str, Held], spec: ExportSpec, *, where: str,
                aliases: Mapping[str, str] | None = None) -> tuple[Sample, int, bool]:
    """The lag sample of a rank's rows (the service's for a push, restricted to these rows: by tensor
    name, then element), the saturated count over them, and whether every element is sampled.

    `served`: the rank's served tensors as it publishes them (whole, or its flat elements of each);
    `masters`: its masters of the same elements, by master name. A scaled format's tensor is measured
    whole (its scales are the whole tensor's): a rank holding a part of one is refused, named."""
    tied: dict[str, tuple[str, ...]] = {}
    for alias, target in (aliases or {}).items():
        tied[target] = (*tied.get(target, ()), alias)
    names = list(served)
    layout: dict[str, tuple[tuple[int, ...], rounding.Format, list[str]]] = {}
    for master, of in rounding.served_masters(names).items():
        _, role = rounding.master_of(of[0], names)
        held = served[of[0]]
        whole = held[2] if held[2] is not None else tuple(held[0].shape)
        shape = rounding.master_shape(role, tuple(whole))
        layout[master] = (shape, spec.format_for(master, shape, tied.get(master, ())), of)
    stride = sample_stride(sum(math.prod(shape) for shape, _, _ in layout.values()))
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    saturated = 0
    for master in sorted(layout):
        shape, fmt, of = layout[master]
        data, offset, count = _rows(served[of[0]])
        if fmt.packed:  # (two elements a byte)
            offset, count = 2 * offset, 2 * count
        if not count:
            continue
        if master not in masters:
            raise ValueError(f"{where}: tensor {master!r}: the rank publishes elements [{offset}, {offset + count}) "
                             "of its served copy but gives no master of them")
        m_data, m_offset, m_count = _rows(masters[master])
        if (m_offset, m_count) != (offset, count):
            raise ValueError(f"{where}: tensor {master!r}: the master given holds elements [{m_offset}, "
                             f"{m_offset + m_count}), the served copy published [{offset}, {offset + count})")
        codes = _codes(data, fmt)
        if fmt.scaled:
            if count != math.prod(shape):
                raise ValueError(f"{where}: tensor {master!r}: the lag of a {fmt.name} tensor is measured whole (its "
                                 f"scales are the whole tensor's); this rank holds elements [{offset}, "
                                 f"{offset + count}) of {math.prod(shape)}")
            values = rounding.dequantize({n: served[n][0] for n in of}, master, fmt, shape, spec.scaling).reshape(-1)
        else:
            values = rounding.decode(codes, fmt)
        idx = sampled_indices(offset, count, stride)
        parts.append((_numpy(m_data, idx).astype(np.float32), values[idx].astype(np.float32),
                      codes[idx].astype(np.uint32)))
        saturated += _saturated(codes, values, m_data, fmt)
    sample = Sample(*(np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, dt)
                      for i, dt in enumerate((np.float32, np.float32, np.uint32))))
    return sample, saturated, stride == 1


def measure(lag: RankLag, version: int, masters: Mapping[str, Held], served: Mapping[str, Held], spec: ExportSpec,
            *, where: str, aliases: Mapping[str, str] | None = None) -> tuple[LagSums, LagRows]:
    """This version's sums of the rank's rows, and the rank's state once it commits (`lag` unchanged)."""
    rows = lag.rows.snapshot()
    sums = rows.observe(version, *rank_sample(masters, served, spec, where=where, aliases=aliases))
    return sums, rows
