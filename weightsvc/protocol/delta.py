"""Delta pulls: the served bytes of a version encoded as changes from a version the client holds.

Per tensor, the smallest of: nothing (unchanged), the dense bytes, sparse element indices plus the
new values, or a bitmask plus the new values. Elements are compared as whole served codes (1, 2 or 4
bytes). The format is documented with the `Delta` message in weightsvc.proto.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np

from weightsvc.protocol.manifest import DTYPE_SIZES, Manifest

UNCHANGED, DENSE, SPARSE, BITMASK = 0, 1, 2, 3
_CODES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def compatible(a: Manifest, b: Manifest) -> bool:
    """Same tensors, shapes, dtypes and offsets: a delta between them is meaningful."""
    key = [(t.name, t.shape, t.dtype, t.offset) for t in a.tensors]
    return a.data_bytes == b.data_bytes and key == [(t.name, t.shape, t.dtype, t.offset) for t in b.tensors]


def most_bytes(manifest: Manifest) -> int:
    """The size of the largest delta `encode` makes of a version laid out as `manifest`: every tensor
    dense (it picks the smallest encoding of each)."""
    return struct.calcsize("<BQ") * len(manifest.tensors) + manifest.data_bytes


def _index_dtype(numel: int) -> type[np.unsignedinteger]:
    return np.uint32 if numel < 1 << 32 else np.uint64


def encode(manifest: Manifest, data: memoryview, base: memoryview) -> bytes:
    """The delta of `data` against `base` (same layout), tensor by tensor in manifest order."""
    parts: list[bytes] = []
    for t in manifest.tensors:
        size = DTYPE_SIZES[t.dtype]
        cur = np.frombuffer(data, _CODES[size], t.nbytes // size, t.offset)
        old = np.frombuffer(base, _CODES[size], t.nbytes // size, t.offset)
        changed = cur != old
        count = int(np.count_nonzero(changed))
        numel = cur.size
        idx_size = np.dtype(_index_dtype(numel)).itemsize
        options = {DENSE: t.nbytes, SPARSE: count * (idx_size + size), BITMASK: -(-numel // 8) + count * size}
        kind = UNCHANGED if count == 0 else min(options, key=options.__getitem__)
        parts.append(struct.pack("<BQ", kind, count))
        if kind == DENSE:
            parts.append(cur.tobytes())
        elif kind == SPARSE:
            parts.append(np.flatnonzero(changed).astype(_index_dtype(numel)).tobytes())
            parts.append(cur[changed].tobytes())
        elif kind == BITMASK:
            parts.append(np.packbits(changed, bitorder="little").tobytes())
            parts.append(cur[changed].tobytes())
    return b"".join(parts)


def apply(manifest: Manifest, delta: memoryview, out: memoryview) -> None:
    """Patch `out` (a copy of the base's data section) into the data section of `manifest`."""
    data = np.frombuffer(out, np.uint8)
    apply_to(manifest, delta, {t.name: data[t.offset : t.offset + t.nbytes] for t in manifest.tensors})


def apply_to(manifest: Manifest, delta: memoryview, out: Mapping[str, np.ndarray]) -> None:
    """Patch the bytes of each tensor of `manifest` (`out[name]`, writable uint8 arrays holding the
    base's bytes of it) into the new version's. ValueError for an encoding that is not one of `manifest`."""
    pos = 0
    for t in manifest.tensors:
        size = DTYPE_SIZES[t.dtype]
        codes = out[t.name].view(_CODES[size])
        if len(delta) < pos + 9:
            raise ValueError(f"tensor {t.name!r}: the delta ends before it")
        kind, count = struct.unpack_from("<BQ", delta, pos)
        pos += 9
        if kind == DENSE:
            codes[:] = np.frombuffer(delta, _CODES[size], codes.size, pos)
            pos += t.nbytes
        elif kind == SPARSE:
            idx_dtype = _index_dtype(codes.size)
            idx = np.frombuffer(delta, idx_dtype, count, pos)
            pos += count * np.dtype(idx_dtype).itemsize
            codes[idx] = np.frombuffer(delta, _CODES[size], count, pos)
            pos += count * size
        elif kind == BITMASK:
            nmask = -(-codes.size // 8)
            mask = np.unpackbits(np.frombuffer(delta, np.uint8, nmask, pos), count=codes.size, bitorder="little")
            pos += nmask
            codes[mask.astype(bool)] = np.frombuffer(delta, _CODES[size], count, pos)
            pos += count * size
        elif kind != UNCHANGED:
            raise ValueError(f"tensor {t.name!r}: unknown delta kind {kind}")
    if pos != len(delta):
        raise ValueError(f"delta has {len(delta) - pos} trailing bytes")
