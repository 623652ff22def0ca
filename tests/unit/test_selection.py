"""Where a tensor's bytes, or a slice's, lie in a version's data section (`byte_ranges`), and the
selection's gather that copies by the same ranges: checked against numpy slicing of the same bytes,
over random shapes, every dim, random ranges and every served dtype."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsvc import rounding
from weightsvc.protocol.manifest import DTYPE_SIZES, Manifest, ServedTensor, Slice, layout
from weightsvc.protocol.parts import Segment
from weightsvc.protocol.selection import byte_ranges, gather

NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "U8": np.uint8}
assert NUMPY_DTYPES.keys() == DTYPE_SIZES.keys()  # every served dtype


@st.composite
def tensors(draw: st.DrawFn) -> tuple[ServedTensor, Slice | None]:
    """A tensor of 1-4 dims (some of size 1, now and then one of size 0) at some offset, whole or
    sliced on any of its dims."""
    shape = tuple(draw(st.lists(st.integers(0, 7) | st.just(1), min_size=1, max_size=4)))
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    t = ServedTensor("w", shape, dtype, draw(st.integers(0, 64)), math.prod(shape) * DTYPE_SIZES[dtype])
    dims = [d for d, size in enumerate(shape) if size > 0]
    if not dims or draw(st.integers(0, 3)) == 0:  # a quarter whole
        return t, None
    dim = draw(st.sampled_from(dims))
    start = draw(st.integers(0, shape[dim] - 1))
    return t, Slice(dim, start, draw(st.integers(start + 1, shape[dim])))


def positions(t: ServedTensor, cut: Slice | None) -> np.ndarray:
    """The data section's offsets of the slice's bytes in row-major order, by numpy slicing of the
    tensor's byte positions (an element's bytes as a last axis of `itemsize`)."""
    grid = (t.offset + np.arange(t.nbytes)).reshape(*t.shape, DTYPE_SIZES[t.dtype])
    if cut is not None:
        grid = grid[(slice(None),) * cut.dim + (slice(cut.start, cut.stop),)]
    return grid.reshape(-1)


@settings(max_examples=400, deadline=None)
@given(tensors())
def test_byte_ranges_are_the_slices_bytes_in_as_few_ranges_as_the_layout_allows(
    case: tuple[ServedTensor, Slice | None],
) -> None:
    t, cut = case
    ranges = byte_ranges(t, cut)
    covered = np.concatenate([np.arange(o, o + n) for o, n in ranges]) if ranges else np.arange(0)
    assert covered.tolist() == positions(t, cut).tolist()
    assert all(n > 0 for _, n in ranges)
    # In order, apart: no two ranges touch, so no fewer ranges cover these bytes.
    assert all(o1 + n1 < o2 for (o1, n1), (o2, _) in itertools.pairwise(ranges))


def test_whole_tensors_and_dim_0_ranges_are_one_range_and_columns_one_per_row() -> None:
    t = ServedTensor("w", (6, 10), "BF16", 100, 120)
    assert byte_ranges(t, None) == [(100, 120)]
    assert byte_ranges(t, Slice(0, 2, 5)) == [(140, 60)]
    assert byte_ranges(t, Slice(1, 4, 7)) == [(100 + 20 * r + 8, 6) for r in range(6)]  # R ranges
    assert byte_ranges(t, Slice(1, 0, 10)) == [(100, 120)]  # all of a dim: the whole tensor
    cube = ServedTensor("c", (1, 3, 4, 5), "F32", 0, 240)
    assert byte_ranges(cube, Slice(1, 1, 3)) == [(80, 160)]  # only a size-1 dim before it: one range
    assert byte_ranges(cube, Slice(2, 1, 3)) == [(20, 40), (100, 40), (180, 40)]  # one per index of dims 0-1
    assert byte_ranges(cube, Slice(3, 4, 5)) == [(16 + 20 * i, 4) for i in range(12)]
    assert byte_ranges(ServedTensor("e", (4, 0), "BF16", 8, 0), None) == []  # no bytes, no range


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_microscaled_layouts_slice_exactly(fmt: str) -> None:
    """FP4 is served two elements per U8 byte: a column slice of its `_packed` tensor is the elements
    of twice its columns, each row one range; the block scales slice like any U8/F8 tensor."""
    f = rounding.FORMATS[fmt]
    served = rounding.served_tensors("l.0.mlp.up.weight", (6, 128), f)
    placed, data_bytes = layout(served)
    data = np.random.default_rng(0).integers(0, 256, data_bytes, dtype=np.uint8)
    for t in placed:
        for cut in [None, *(Slice(d, 1, t.shape[d] - 1) for d in range(len(t.shape)) if t.shape[d] > 2)]:
            ranges = byte_ranges(t, cut)
            got = np.concatenate([data[o : o + n] for o, n in ranges])
            assert got.tolist() == data[positions(t, cut)].tolist(), (t.name, cut)
            if cut is not None and cut.dim == 1:
                assert len(ranges) == t.shape[0]
    if not f.packed:
        return
    packed = next(t for t in placed if t.name.endswith(rounding.PACKED_SUFFIX))  # (6, 64): elements two per byte
    (first, nbytes), *_ = byte_ranges(packed, Slice(1, 8, 24))
    elements = rounding.unpack(data[first : first + nbytes])
    assert elements.tolist() == rounding.unpack(data[packed.offset : packed.offset + 64])[16:48].tolist()


def manifest_of(placed: list[ServedTensor], data_bytes: int) -> Manifest:
    return Manifest("m", 1, "bf16", "sr", 0, 0.0, data_bytes, "", tuple(placed))


@settings(max_examples=150, deadline=None)
@given(st.lists(tensors(), min_size=1, max_size=4), st.integers(0, 3), st.data())
def test_gather_copies_exactly_the_ranges(
    cases: list[tuple[ServedTensor, Slice | None]], held_from: int, draw: st.DataObject
) -> None:
    """A selection's segments are the slices' bytes (numpy slicing of the typed tensor), read from all
    of the data section or from a replica's part, which holds it at another offset in its own data."""
    placed, data_bytes = layout([(f"t{i}", t.shape, t.dtype) for i, (t, _) in enumerate(cases)])
    cuts = {f"t{i}": cut for i, (_, cut) in enumerate(cases)}
    section = np.random.default_rng(draw.draw(st.integers(0, 2**32 - 1))).integers(0, 256, data_bytes, dtype=np.uint8)
    # A part: the section from the `held_from`-th tensor on, at `local` in this replica's data.
    start = sorted(placed, key=lambda t: t.offset)[min(held_from, len(placed) - 1)].offset
    local = draw.draw(st.integers(0, 9))
    data = np.concatenate([np.zeros(local, np.uint8), section[start:]])
    held = {t.name: cuts[t.name] for t in placed if t.offset >= start}
    if not held:
        return
    sel = gather(manifest_of(placed, data_bytes), memoryview(data.tobytes()),
                 [Segment(start, local, data_bytes - start)], held)
    by_name = {t.name: t for t in placed}
    for t, segment in zip(sel.manifest.tensors, sel.segments, strict=True):
        v = by_name[t.name]
        typed = section[v.offset : v.offset + v.nbytes].view(NUMPY_DTYPES[v.dtype]).reshape(v.shape)
        cut = held[t.name]
        if cut is not None:
            typed = typed[(slice(None),) * cut.dim + (slice(cut.start, cut.stop),)]
        assert bytes(segment) == np.ascontiguousarray(typed).tobytes(), (v, cut)
