"""Checksums of served tensors, and the digest of a version's masters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import xxhash

from weightsvc.errors import DataLoss, subject
from weightsvc.protocol.manifest import DTYPE_SIZES, Manifest

CHECKSUM_PREFIX = "xxh3_64:"


def checksum(data: Any) -> str:
    return CHECKSUM_PREFIX + xxhash.xxh3_64_hexdigest(data)


class StreamedChecksum:
    """`checksum` of a tensor's served bytes, hashed chunk by chunk as they are written (while they
    are still in cache: the same value, xxh3 streams). Chunks that come out of order (the parts of
    several ranks) end the stream, and `value` hashes the bytes whole."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()
        self._end = 0

    def update(self, offset: int, data: Any) -> None:
        if offset == self._end:
            self._hash.update(data)
            self._end += memoryview(data).nbytes

    def value(self, data: Any) -> str:
        if self._end == memoryview(data).nbytes:
            return CHECKSUM_PREFIX + self._hash.hexdigest()
        return checksum(data)


def verify(name: str, data: Any, expected: str, *, where: str) -> None:
    verify_checksum(name, checksum(data), expected, where=where)


def verify_checksum(name: str, got: str, expected: str, *, where: str) -> None:
    if got != expected:
        raise DataLoss(f"{where}: tensor {name!r} checksum mismatch (got {got}, manifest says {expected})")


def verify_data(manifest: Manifest, data: bytearray | memoryview) -> None:
    """Check that every served tensor fits the data section and matches its manifest checksum."""
    view = memoryview(data)
    where = subject(manifest.model, manifest.version)
    for t in manifest.tensors:
        if (
            t.dtype not in DTYPE_SIZES
            or t.nbytes != math.prod(t.shape) * DTYPE_SIZES[t.dtype]
            or (t.offset + t.nbytes > len(view))
        ):
            raise DataLoss(
                f"{where}: tensor {t.name!r} ({t.dtype}, shape {list(t.shape)}, {t.nbytes} bytes "
                f"at {t.offset}) does not fit the manifest's data section"
            )
        verify(t.name, view[t.offset : t.offset + t.nbytes], t.checksum, where=where)


DIGEST_BLOCK = 1 << 20


class MasterDigest:
    """Digest of one master tensor's bytes that does not depend on how they were chunked or split
    across learner ranks: xxh3-128 over the xxh3-128 of each aligned 1 MiB block. Pieces of a block
    that arrive separately (a rank boundary or an unaligned chunk inside it) are gathered first."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._blocks: dict[int, bytes] = {}
        self._partial: dict[int, tuple[bytearray, int]] = {}  # block -> (bytes so far, count filled)

    def update(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        pos, end = offset, offset + len(view)
        while pos < end:
            block = pos // DIGEST_BLOCK
            start = block * DIGEST_BLOCK
            stop = min(start + DIGEST_BLOCK, self.nbytes)
            piece = view[pos - offset : min(end, stop) - offset]
            if pos == start and len(piece) == stop - start:
                self._blocks[block] = xxhash.xxh3_128_digest(piece)
            else:
                entry = self._partial.pop(block, None)
                buf, filled = entry if entry is not None else (bytearray(stop - start), 0)
                buf[pos - start : pos - start + len(piece)] = piece
                filled += len(piece)
                if filled == len(buf):
                    self._blocks[block] = xxhash.xxh3_128_digest(buf)
                else:
                    self._partial[block] = (buf, filled)
            pos += len(piece)

    def hexdigest(self) -> str:
        count = -(-self.nbytes // DIGEST_BLOCK)
        assert len(self._blocks) == count and not self._partial, "digest of an incomplete tensor"
        return xxhash.xxh3_128_hexdigest(b"".join(self._blocks[i] for i in range(count)))


def masters_digest(tensors: Iterable[tuple[str, tuple[int, ...], str]], aliases: Iterable[tuple[str, str]]) -> str:
    """The digest of a version's masters in its manifest: each tensor's (name, shape, `MasterDigest`),
    by name, then the ties (alias, tensor), by alias: independent of order, chunking and ranks."""
    h = xxhash.xxh3_128()
    for name, shape, digest in sorted(tensors):
        h.update(f"{name}\x00{list(shape)}\x00{digest}\n".encode())
    for alias, target in sorted(aliases):
        h.update(f"{alias}\x00={target}\n".encode())
    return "xxh3_128:" + h.hexdigest()
