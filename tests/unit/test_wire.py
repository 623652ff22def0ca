"""The hand-written chunk framing must be byte-identical to protobuf's, both ways."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from weightsvc.protocol.wire import ChunkView, Malformed, decode_chunk, decode_push_request, encode_chunk
from weightsvc.v1 import weightsvc_pb2 as pb

names = st.text(max_size=40)
offsets = st.integers(min_value=-(2**63), max_value=2**63 - 1)
payloads = st.binary(max_size=3000)


@given(names, offsets, payloads)
def test_encode_matches_protobuf(tensor: str, offset: int, data: bytes) -> None:
    expected = pb.PushRequest(chunk=pb.Chunk(tensor=tensor, offset=offset, data=data)).SerializeToString()
    assert encode_chunk(tensor, offset, memoryview(data)) == expected
    assert pb.PullResponse.FromString(encode_chunk(tensor, offset, data)).chunk.data == data


@given(names, offsets, payloads)
def test_decode_matches_protobuf(tensor: str, offset: int, data: bytes) -> None:
    raw = pb.PushRequest(chunk=pb.Chunk(tensor=tensor, offset=offset, data=data)).SerializeToString()
    got = decode_chunk(raw)
    assert isinstance(got, ChunkView)
    assert (got.tensor, got.offset, bytes(got.data)) == (tensor, offset, data)


def test_other_messages_go_through_protobuf() -> None:
    header = pb.PushRequest(header=pb.PushHeader(model="m", step=3))
    assert decode_push_request(header.SerializeToString()) == header
    commit = pb.PushRequest(commit=pb.PushCommit())
    assert decode_push_request(commit.SerializeToString()) == commit


def test_truncated_chunk_is_reported_not_raised() -> None:
    raw = encode_chunk("w", 0, b"x" * 100)
    got = decode_push_request(raw[:-10])
    assert isinstance(got, Malformed)
    assert "PushRequest" in got.reason


def test_overlong_varint_keeps_the_low_64_bits_like_protobuf() -> None:
    # offset field (2) as a 10-byte varint of all ones: protobuf reads -1
    inner = b"\x10" + b"\xff" * 9 + b"\x01"
    raw = b"\x12" + bytes([len(inner)]) + inner
    assert pb.PushRequest.FromString(raw).chunk.offset == -1
    got = decode_chunk(raw)
    assert isinstance(got, ChunkView) and got.offset == -1


def test_field_number_zero_is_malformed() -> None:
    inner = b"\x02\x01x"  # field 0, length-delimited
    raw = b"\x12" + bytes([len(inner)]) + inner
    assert isinstance(decode_push_request(raw), Malformed)
