"""Sliced pulls: a tensor-parallel worker pulls only the tensors, and the rows or columns of tensors,
that it needs.

A selection maps tensor names to a `Slice` of the tensor, or to None for the whole tensor. Its
manifest lays the selected tensors out as a version's are (`layout`: wider dtypes first, selection
order within a dtype), each with the slice's shape, the checksum of exactly its bytes and the slice
it is of; its data section is gathered from the version's bytes (a whole tensor or a dim-0 range is
a view of them, any other slice a copy). Over HTTP a selection is a list of `NAME` (whole) and
`NAME@DIM:START:STOP` selectors.

Where the bytes of a tensor, or of a slice of it, lie in a version's data section is computed once,
here (`byte_ranges`): the selection's gather copies by it, and `Version.pieces` turns the same ranges
into views of memory or ranges of the version's file for a transport that reads them in place.

Numpy is loaded by the first slice that needs a copy: the clients import this module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from weightsvc.errors import FailedPrecondition, InvalidArgument, subject
from weightsvc.memory import alloc
from weightsvc.protocol.digest import checksum
from weightsvc.protocol.manifest import DTYPE_SIZES, Manifest, Part, ServedTensor, Slice, layout
from weightsvc.protocol.parts import Segment, held_span

Select = Mapping[str, Slice | None]  # tensor name -> the slice of it, or None for the whole tensor
_SLICED = re.compile(r"(-?[0-9]{1,19}):(-?[0-9]{1,19}):(-?[0-9]{1,19})")  # ASCII: int() reads any digits


def selection(pairs: Iterable[tuple[str, Slice | None]]) -> dict[str, Slice | None]:
    """A selection from the (name, slice) pairs of a request; INVALID_ARGUMENT if a name comes twice."""
    out: dict[str, Slice | None] = {}
    for name, cut in pairs:
        if name in out:
            raise InvalidArgument(f"tensor {name!r} is selected twice: select each tensor once")
        out[name] = cut
    return out


def selector(name: str, cut: Slice | None) -> str:
    """The text form of one selected tensor: `NAME` (whole) or `NAME@DIM:START:STOP`."""
    return name if cut is None else f"{name}@{cut.dim}:{cut.start}:{cut.stop}"


def parse_selector(text: str) -> tuple[str, Slice | None]:
    """`NAME@DIM:START:STOP` split on its last '@'; any other text is the name of a whole tensor."""
    name, at, spec = text.rpartition("@")
    sliced = _SLICED.fullmatch(spec)
    if at and sliced:
        dim, start, stop = map(int, sliced.groups())
        return name, Slice(dim, start, stop)
    return text, None


def sliced_shape(shape: tuple[int, ...], cut: Slice | None) -> tuple[int, ...]:
    if cut is None:
        return shape
    return (*shape[: cut.dim], cut.stop - cut.start, *shape[cut.dim + 1 :])


def chosen(manifest: Manifest, select: Select) -> list[tuple[ServedTensor, Slice | None]]:
    """The version's tensors that `select` names, in its order, with their slices. INVALID_ARGUMENT
    names an unknown tensor, a dim the tensor does not have, or a range that is empty or outside it."""
    where = subject(manifest.model, manifest.version)
    if not select:
        raise InvalidArgument(f"{where}: the selection is empty: select at least one tensor")
    by_name = {t.name: t for t in manifest.tensors}
    return [(picked(manifest, by_name, name, cut), cut) for name, cut in select.items()]


def picked(manifest: Manifest, by_name: Mapping[str, ServedTensor], name: str, cut: Slice | None) -> ServedTensor:
    """The tensor `name` of the version (`by_name`: its tensors by name), checked to have the slice `cut`
    (INVALID_ARGUMENT as `chosen` words it)."""
    t = by_name.get(name)
    if t is None:
        raise InvalidArgument(f"{subject(manifest.model, manifest.version)} has no tensor {name!r} to select")
    if cut is not None:
        what = f"{subject(manifest.model, manifest.version)}: tensor {name!r} of shape {list(t.shape)}"
        if not 0 <= cut.dim < len(t.shape):
            dims = f"dims 0 to {len(t.shape) - 1}" if t.shape else "no dims: select it whole"
            raise InvalidArgument(f"{what} has no dim {cut.dim} ({dims})")
        size = t.shape[cut.dim]
        if not 0 <= cut.start < cut.stop <= size:
            raise InvalidArgument(
                f"{what}: range [{cut.start}, {cut.stop}) of dim {cut.dim} is empty or outside [0, {size})"
            )
    return t


def part_of(manifest: Manifest, t: ServedTensor) -> Part:
    """The part of a version of parts (sharded replicas) that holds tensor `t`."""
    return next(p for p in manifest.parts if p.offset <= t.offset and t.offset + t.nbytes <= p.offset + p.nbytes)


def holders_by_tensor(manifest: Manifest) -> dict[str, tuple[str, ...]]:
    """The replicas that hold each tensor of a version of parts, in one pass: its tensors and its
    parts both follow the order of the data section (an ef push reads it as it opens)."""
    out: dict[str, tuple[str, ...]] = {}
    parts = iter(manifest.parts)
    p = next(parts, None)
    for t in manifest.tensors:
        while p is not None and t.offset + t.nbytes > p.offset + p.nbytes:
            p = next(parts, None)
        if p is None:
            break
        out[t.name] = p.sources
    return out


def owner_of(manifest: Manifest, t: ServedTensor) -> str:
    """The replicas that hold tensor `t` of a version of parts, as text."""
    return ", ".join(part_of(manifest, t).sources)


def by_part(manifest: Manifest, select: Select) -> dict[Part, dict[str, Slice | None]]:
    """A selection of a version of parts, split by the part that holds each selected tensor."""
    groups: dict[Part, dict[str, Slice | None]] = {}
    for t, cut in chosen(manifest, select):
        groups.setdefault(part_of(manifest, t), {})[t.name] = cut
    return groups


def _runs(t: ServedTensor, cut: Slice | None) -> tuple[int, int, int, int]:
    """Where `cut` of tensor `t` (None: all of it) lies in the data section, as (offset, count, nbytes,
    stride): `count` runs of `nbytes` bytes, the first at `offset`, each `stride` after the one before.

    Row-major: a slice on dim d is one run per index of the dims before d, each the slice's block of
    the dims from d on. Runs that touch are one: a whole tensor, a range of dim 0 (or of a dim after
    dims of size 1) and all of a dim are one run. Sizes are bytes of served elements (`DTYPE_SIZES`):
    FP4 is served two elements per U8 byte, so its shape, and any slice of it, is in bytes already.
    No bytes: no runs (count 0)."""
    if cut is None:
        return t.offset, 1 if t.nbytes else 0, t.nbytes, t.nbytes
    inner = math.prod(t.shape[cut.dim + 1 :]) * DTYPE_SIZES[t.dtype]  # bytes of one index of `dim`
    count = math.prod(t.shape[: cut.dim])
    offset, nbytes, stride = t.offset + cut.start * inner, (cut.stop - cut.start) * inner, t.shape[cut.dim] * inner
    if count == 0 or nbytes == 0:
        return offset, 0, 0, stride
    if count == 1 or nbytes == stride:
        return offset, 1, count * nbytes, count * nbytes
    return offset, count, nbytes, stride


def byte_ranges(t: ServedTensor, cut: Slice | None) -> list[tuple[int, int]]:
    """Where `cut` of tensor `t` (None: all of it) lies: (offset in the data section, nbytes) ranges in
    row-major order, as few as the layout allows and none empty. A whole tensor or a range of dim 0 is
    one range; a slice on dim d is one per index of the dims before it (an [R, C] tensor's columns: R).
    The slice is taken as given: `chosen` checks it against the tensor."""
    offset, count, nbytes, stride = _runs(t, cut)
    return [(at, nbytes) for at in range(offset, offset + count * stride, stride)] if count else []


def _bytes_of(t: ServedTensor, cut: Slice | None, data: memoryview, skip: int) -> memoryview:
    """The bytes of `cut` of tensor `t` (`byte_ranges`) from `data`, which holds byte `o` of the data
    section at `o - skip`: a view when they are one range, else one copy. The copy is one strided numpy
    gather over the runs, not a loop over ranges: a tall tensor's columns are many short ones."""
    offset, count, nbytes, stride = _runs(t, cut)
    at = offset - skip
    if count <= 1:
        return data[at : at + count * nbytes]
    import numpy as np

    span = np.frombuffer(data, np.uint8, count=(count - 1) * stride + nbytes, offset=at)
    runs = np.lib.stride_tricks.as_strided(span, (count, nbytes), (stride, 1), writeable=False)
    return np.ascontiguousarray(runs).reshape(-1).data


@dataclass(frozen=True)
class Selected:
    """A selection of a version, ready to send: its manifest, its safetensors header and ETag, and the
    bytes of each of its tensors, in the manifest's order."""

    manifest: Manifest
    header: bytes
    etag: str
    segments: tuple[memoryview, ...]

    @property
    def size(self) -> int:
        """Bytes of the selection's safetensors file."""
        return len(self.header) + self.manifest.data_bytes

    def chunks(self, start: int, size: int) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) pieces of at most `size` bytes of the selection's data section from `start`
        on; a piece never spans two tensors."""
        for t, segment in zip(self.manifest.tensors, self.segments, strict=True):
            end = t.offset + t.nbytes
            for at in range(max(start, t.offset), end, size):
                yield at, segment[at - t.offset : min(end, at + size) - t.offset]

    def file_range(self, start: int, end: int, size: int) -> Iterator[memoryview]:
        """Pieces of at most `size` bytes covering [start, end) of the selection's safetensors file."""
        head = memoryview(self.header)
        for at in range(start, min(end, len(head)), size):
            yield head[at : min(end, len(head), at + size)]
        stop = end - len(head)
        for at, piece in self.chunks(max(0, start - len(head)), size):
            if at >= stop:
                return
            yield piece[: stop - at]


def gather(manifest: Manifest, data: memoryview, spans: Sequence[Segment], select: Select,
           holder: str = "") -> Selected:
    """The selection `select` of the version `manifest`, from the ranges of its data section that this
    server holds (`spans`: all of it, or a sharded replica's parts, `holder`'s) in `data`.
    FAILED_PRECONDITION names the selected tensors that other replicas hold. Blocking: it hashes and
    copies (run it off the event loop)."""
    picked = chosen(manifest, select)
    skips: dict[str, int] = {}  # tensor -> its offset in the data section less its offset in `data`
    for t, _ in picked:
        held = held_span(spans, t.offset, t.offset + t.nbytes)
        if held is not None:
            skips[t.name] = held.start - held.local
    elsewhere = [t for t, _ in picked if t.name not in skips]
    if elsewhere:
        named = ", ".join(f"{t.name!r} ({owner_of(manifest, t)})" for t in elsewhere)
        raise FailedPrecondition(
            f"{subject(manifest.model, manifest.version)} is sharded over replicas, and this one "
            f"({holder}) does not hold the selected tensors {named}: pull each replica's tensors from it "
            "(the InferenceClient does)"
        )
    placed, data_bytes = layout([(t.name, sliced_shape(t.shape, cut), t.dtype) for t, cut in picked])
    source = {t.name: (t, cut) for t, cut in picked}
    tensors, segments = [], []
    for p in placed:
        t, cut = source[p.name]
        piece = _bytes_of(t, cut, data, skips[t.name])
        tensors.append(replace(p, checksum=t.checksum if cut is None else checksum(piece), slice=cut))
        segments.append(piece)
    m = replace(manifest, tensors=tuple(tensors), data_bytes=data_bytes, parts=())
    header = m.safetensors_header()
    return Selected(m, header, m.etag(header), tuple(segments))


def joined(selections: list[tuple[Manifest, memoryview]]) -> tuple[Manifest, memoryview]:
    """The selections of a version pulled from several replicas, as one: back to back, in the order
    given (a tensor after one of odd size, fp8, may sit unaligned)."""
    tensors: list[ServedTensor] = []
    offset = 0
    for m, _ in selections:
        tensors += [replace(t, offset=t.offset + offset) for t in m.tensors]
        offset += m.data_bytes
    data = alloc(offset)
    offset = 0
    for m, part in selections:
        data[offset : offset + m.data_bytes] = part
        offset += m.data_bytes
    return replace(selections[0][0], tensors=tuple(tensors), data_bytes=offset), data
