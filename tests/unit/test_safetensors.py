"""The one reader and writer of the safetensors framing."""

from __future__ import annotations

import json

import pytest

from weightsvc.errors import InvalidArgument
from weightsvc.protocol.safetensors import (
    MAX_HEADER_BYTES,
    check_metadata,
    framed,
    header_length,
    load_header,
    read_safetensors_header,
    tensor_entry,
)


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


@pytest.mark.parametrize(("raw", "words"), [
    (b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nests deeper than any safetensors header does"),
    (b'\xef\xbb\xbf{"w": {}}', "must be a JSON object from its first byte, not start with '\\ufeff'"),
    (b' {"w": {}}', "must be a JSON object from its first byte"),
    (b'{"w": {}, "w": {}}', "the header names ['w'] more than once"),
    (b'{"w": "\xff"}', "can't decode byte 0xff"),
    (b'{"\\ud800": {}}', "holds a lone surrogate '\\ud800'"),  # (JSON's escape of what no UTF-8 holds)
    (b'{"w": {"x": ["\\udfff"]}}', "holds a lone surrogate '\\udfff'"),
])
def test_a_header_is_read_as_strictly_as_the_format_says(raw: bytes, words: str) -> None:
    with pytest.raises(ValueError) as e:
        load_header(raw)
    assert words in str(e.value)


def test_a_padded_header_reads() -> None:
    assert load_header(b'{"w": {}}   ') == {"w": {}}
    assert load_header(b'{"\\ud83d\\ude00": "\\\\ud800"}') == {"\U0001f600": "\\ud800"}  # a pair; a backslash


@pytest.mark.parametrize(("entry", "words"), [
    ([], "its entry is list"),
    ({"dtype": 4, "shape": [], "data_offsets": [0, 4]}, "dtype 4 is not a string"),
    ({"dtype": "F32", "shape": [4.7], "data_offsets": [0, 16]}, "shape [4.7] is not a list of integers"),
    ({"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]}, 'shape ["4"] is not'),
    ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, "shape [true] is not"),
    ({"dtype": "F32", "shape": [float("inf")], "data_offsets": [0, 4]}, "shape [Infinity] is not"),
    ({"dtype": "F32", "shape": [1 << 64], "data_offsets": [0, 4]}, "is not a list of integers in [0, 2^64)"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "is not a list of integers in [0, 2^64)"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0.5, 16.5]}, "data_offsets [0.5, 16.5] are not two integers"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16, 3]}, "data_offsets [0, 16, 3] are not"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "begin <= end"),
    ({"dtype": "F32", "shape": [4]}, "data_offsets null are not"),
])
def test_a_tensor_entry_breaking_the_format_is_refused(entry: object, words: str) -> None:
    with pytest.raises(ValueError) as e:
        tensor_entry(entry)
    assert words in str(e.value)


def test_a_tensor_entry_reads() -> None:
    assert tensor_entry({"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}) == ("F32", (2, 3), 8, 32)
    check_metadata({"format": "pt"})
    with pytest.raises(ValueError, match="__metadata__ 5 does not map names to strings"):
        check_metadata(5)
