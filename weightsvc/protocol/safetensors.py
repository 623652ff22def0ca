"""The framing of a safetensors file, read and written here alone: a little-endian u64 header length,
the JSON header padded with spaces to a multiple of 8 bytes, then the data section."""

from __future__ import annotations

import collections
import json
import re
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
    return 8 + n, load_header(prefix[8 : 8 + n])


def load_header(raw: Prefix) -> dict[str, Any]:
    """The JSON header of a safetensors file, read as strictly as the format's own readers read it:
    UTF-8 without a byte order mark, one JSON object from its first byte (trailing spaces pad it), no
    name twice, no lone surrogate in an escape. A `ValueError` says what is wrong, a header nested
    deeper than Python's parser goes too."""
    text = bytes(raw).decode("utf-8")  # (a UnicodeDecodeError is a ValueError)
    if not text.startswith("{"):
        raise ValueError(f"the header must be a JSON object from its first byte, not start with {text[:1]!r}")
    try:
        header = json.loads(text, object_pairs_hook=_unique_names)
    except RecursionError:
        raise ValueError("the header nests deeper than any safetensors header does") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not one JSON object")
    if _SURROGATE_ESCAPE.search(text):  # (Python's json reads "\ud800" as a str no UTF-8 holds; serde_json refuses it)
        try:
            json.dumps(header, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"a string of it holds a lone surrogate {e.object[e.start : e.end]!r}, which is not "
                             "Unicode text") from None
    return header


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) < len(pairs):
        twice = sorted(k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1)
        raise ValueError(f"the header names {twice[:5]} more than once")
    return out


def _count(x: object) -> bool:
    """A JSON integer the format's readers hold (a u64): not a bool, a float or a string of digits."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64


def tensor_entry(entry: object) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of a header's tensor entry, checked against the format: a dtype
    string, a shape and `data_offsets` [begin, end] of integers in [0, 2^64), begin <= end. A
    `ValueError` says which rule the entry breaks (the caller names the tensor)."""
    if not isinstance(entry, dict):
        raise ValueError(f"its entry is {type(entry).__name__}, not an object of dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise ValueError(f"dtype {_shown(dtype)} is not a string")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise ValueError(f"shape {_shown(shape)} is not a list of integers in [0, 2^64)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise ValueError(f"data_offsets {_shown(offsets)} are not two integers begin <= end in [0, 2^64)")
    return dtype, tuple(shape), offsets[0], offsets[1]


def check_metadata(metadata: object) -> None:
    """`__metadata__` maps names to strings, as the format says."""
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"__metadata__ {_shown(metadata)} does not map names to strings")


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def framed(*header: bytes, size: int | None = None) -> bytes:
    """The file prefix of a JSON header (given whole or in consecutive pieces, joined once): its
    length and the header, padded with spaces to a multiple of 8 bytes, or to `size` bytes in all."""
    n = sum(map(len, header))
    pad = max(0, size - 8 - n) if size is not None else -n % 8
    return b"".join([(n + pad).to_bytes(8, "little"), *header, b" " * pad])
