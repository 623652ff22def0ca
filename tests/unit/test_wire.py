"""The hand-written chunk framing must be byte-identical to protobuf's, both ways."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsvc.protocol import wire
from weightsvc.protocol.lag import LagMetrics
from weightsvc.protocol.manifest import Manifest, ServedTensor, Slice
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


def test_a_manifest_in_pieces_reads_back_whole_and_from_any_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MESSAGE_PIECE_BYTES", 2000)  # a few dozen tensors a piece
    tensors = tuple(ServedTensor(f"layers.{i}.w", (4, i % 5 + 1), "bfloat16", 64 * i, 8 * (i % 5 + 1),
                                 f"xxh3_64:{i:016x}", Slice(1, 0, 1) if i % 7 == 0 else None) for i in range(500))
    m = Manifest("m", 3, "bf16", "sr", 7, 1.5, 64 * 500, "xxh3_128:0", tensors,
                 lag=LagMetrics(0.1, None, 3, 0.2, 0, 10, False), aliases=(("head", "layers.0.w"),))
    pieces = [pb.PullResponse.FromString(p) for p in wire.manifest_pieces(m)]
    assert len(pieces) > 5
    more = [t for p in pieces[1:] for t in p.manifest_tensors.tensors]
    assert wire.manifest_from_proto(pieces[0].manifest, more) == m
    for start in (0, 1, len(pieces[0].manifest.tensors), 250, 499, 500):
        got = wire.manifest_from(m, start)
        assert got.tensor_count == 500 and got.model == "m"
        assert wire.manifest_from_proto(got).tensors == tensors[start : start + len(got.tensors)]
        assert len(got.tensors) or start == 500
