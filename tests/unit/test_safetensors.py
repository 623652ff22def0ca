"""The one reader and writer of the safetensors framing."""

from __future__ import annotations

import json

import pytest

from weightsvc.errors import InvalidArgument
from weightsvc.protocol.safetensors import MAX_HEADER_BYTES, framed, header_length, read_safetensors_header


def test_a_framed_header_reads_back_with_its_data_start() -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    prefix = framed(header)
    assert len(prefix) % 8 == 0 and header_length(prefix) == len(prefix) - 8
    assert read_safetensors_header(prefix + b"\0" * 4) == (len(prefix), json.loads(header))


def test_a_header_framed_in_pieces_is_the_header_framed_whole() -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}).encode()
    for size in (None, 96):
        assert framed(header[:5], header[5:17], header[17:], size=size) == framed(header, size=size)


def test_a_header_padded_to_a_size_keeps_its_json() -> None:
    prefix = framed(b"{}", size=64)
    assert len(prefix) == 64 and header_length(prefix) == 56
    assert read_safetensors_header(prefix) == (64, {})


@pytest.mark.parametrize("prefix", [b"", b"\x08\0\0", (MAX_HEADER_BYTES + 1).to_bytes(8, "little"),
                                    (16).to_bytes(8, "little") + b"{}"])
def test_what_is_not_a_safetensors_prefix_is_refused(prefix: bytes) -> None:
    with pytest.raises(InvalidArgument, match="not a safetensors file"):
        read_safetensors_header(prefix)
