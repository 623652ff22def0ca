"""The framing of a safetensors file, read and written here alone: a little-endian u64 header length,
the JSON header padded with spaces to a multiple of 8 bytes, then the data section."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from weightsvc.errors import InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    import mmap

    Prefix = bytes | bytearray | memoryview | mmap.mmap

# The largest header safetensors readers take (the format's own limit): a version whose file header
# would be larger is refused before it commits, so that every committed version can be read back.
MAX_HEADER_BYTES = 100_000_000


def check_header_size(nbytes: int, where: str) -> None:
    if nbytes > MAX_HEADER_BYTES:
        raise ResourceExhausted(
            f"{where}: the version's file header would hold {nbytes} bytes (its tensors' names, shapes and "
            f"checksums), more than the {MAX_HEADER_BYTES} a safetensors header may: push fewer tensors or "
            "shorter names",
            reason="too_large",
        )


def header_length(prefix: Prefix) -> int:
    """The length of the JSON header, from a safetensors file's first 8 bytes (not checked against
    anything: each reader knows what it may take)."""
    if len(prefix) < 8:
        raise InvalidArgument("not a safetensors file: shorter than 8 bytes")
    return int.from_bytes(prefix[:8], "little")


def read_safetensors_header(prefix: Prefix) -> tuple[int, dict[str, Any]]:
    """(data section start, header dict) of a safetensors file given its first bytes."""
    n = header_length(prefix)
    if n > MAX_HEADER_BYTES or len(prefix) < 8 + n:
        raise InvalidArgument(f"not a safetensors file: header length {n} is out of range")
    return 8 + n, json.loads(bytes(prefix[8 : 8 + n]))


def framed(*header: bytes, size: int | None = None) -> bytes:
    """The file prefix of a JSON header (given whole or in consecutive pieces, joined once): its
    length and the header, padded with spaces to a multiple of 8 bytes, or to `size` bytes in all."""
    n = sum(map(len, header))
    pad = max(0, size - 8 - n) if size is not None else -n % 8
    return b"".join([(n + pad).to_bytes(8, "little"), *header, b" " * pad])
