"""The protobuf side of weightsvc: manifest conversions, and zero-copy framing of `Chunk` messages.

Push and Pull carry almost all bytes in `Chunk` messages. Going through protobuf objects costs two
extra copies per chunk (bytes -> message -> wire, and back); on a 2-core machine that halves the
throughput. These helpers read and write the same wire format directly: a chunk is encoded from a
memoryview with one join, and decoded into memoryview slices of the received buffer. Every other
message goes through the generated classes, and any peer that speaks plain protobuf interoperates.

Wire format (weightsvc.proto): PushRequest.chunk and PullResponse.chunk are field 2 (length
delimited) holding Chunk {1: tensor string, 2: offset int64 varint, 3: data bytes}.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from weightsvc._aio import memo
from weightsvc.errors import InvalidArgument, subject
from weightsvc.protocol.adapter import Adapter
from weightsvc.protocol.lag import LagMetrics
from weightsvc.protocol.manifest import Manifest, Part, ServedTensor, Slice
from weightsvc.protocol.mismatch import RolloutMismatch, mismatch_to_proto
from weightsvc.protocol.selection import Select, selection
from weightsvc.v1 import weightsvc_pb2 as pb

_CHUNK_FIELD = 2


@dataclass(frozen=True)
class ChunkView:
    tensor: str
    offset: int
    data: memoryview


@dataclass(frozen=True)
class Malformed:
    reason: str


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos  # protobuf keeps the low 64 bits
        shift += 7


def encode_chunk(tensor: str, offset: int, data: memoryview | bytes | list[memoryview]) -> bytes:
    """Serialized PushRequest/PullResponse with field `chunk` set (identical to protobuf's bytes).
    `data` may come in pieces (packed small tensors): they are joined once, with the framing."""
    return b"".join(chunk_pieces(tensor, offset, data))


def chunk_pieces(tensor: str, offset: int, data: memoryview | bytes | list[memoryview]
                 ) -> list[bytes | memoryview]:
    """`encode_chunk`'s bytes in pieces, not joined: the framing, then the data as given (a sender
    that writes them one after the other copies no data)."""
    pieces = data if isinstance(data, list) else [data]
    n = sum(len(p) for p in pieces)
    inner = bytearray()
    if tensor:
        name = tensor.encode()
        inner += b"\x0a" + _varint(len(name)) + name
    if offset:
        inner += b"\x10" + _varint(offset & 0xFFFFFFFFFFFFFFFF)
    if n:
        inner += b"\x1a" + _varint(n)
    return [b"".join((b"\x12", _varint(len(inner) + n), inner)), *pieces]


def decode_chunk(raw: bytes) -> ChunkView | None:
    """The chunk of a serialized PushRequest/PullResponse as views into `raw`; None if not a chunk."""
    buf = memoryview(raw)
    if not buf or buf[0] != (_CHUNK_FIELD << 3 | 2):
        return None
    size, pos = _read_varint(buf, 1)
    end = pos + size
    if end != len(buf):
        return None  # more fields follow: let protobuf handle the general case
    tensor, offset, data = "", 0, buf[0:0]
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise DecodeError("field number 0")
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            if field == 2:
                offset = value - (1 << 64) if value >= 1 << 63 else value
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            if pos + n > end:
                raise DecodeError("truncated field")
            if field == 1:
                tensor = bytes(buf[pos : pos + n]).decode()
            elif field == 3:
                data = buf[pos : pos + n]
            pos += n
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise DecodeError(f"unsupported wire type {wire}")
    if pos != end:
        raise DecodeError("truncated chunk")
    return ChunkView(tensor, offset, data)


def decode_push_request(raw: bytes) -> pb.PushRequest | ChunkView | Malformed:
    try:
        return decode_chunk(raw) or pb.PushRequest.FromString(raw)
    except (DecodeError, UnicodeDecodeError) as e:
        return Malformed(f"malformed PushRequest: {e}")


def decode_pull_response(raw: bytes) -> pb.PullResponse | ChunkView:
    return decode_chunk(raw) or pb.PullResponse.FromString(raw)


def encode_message(msg: pb.PushRequest | pb.PullResponse | bytes) -> bytes:
    """Serializer for streams that mix generated messages with pre-encoded chunks."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


# A big header or manifest goes in messages of about this many bytes: well under the 8 MiB limit.
MESSAGE_PIECE_BYTES = 4 << 20
# The largest HTTP/2 frame each end of a gRPC channel accepts (HTTP/2's own maximum). The default,
# 16 KiB, cuts a 1 MiB chunk into 64 frames, each parsed by the receiver: with whole chunks in one
# frame a 512 MiB pull cost the client 0.16-0.18 CPU s, against 0.17-0.65 s with the default.
HTTP2_FRAME_OPTION = ("grpc.http2.max_frame_size", (1 << 24) - 1)


def _add_tensors(field: Any, tensors: Iterable[ServedTensor]) -> None:
    """Append each tensor to a repeated ServedTensor field, one call each: a list of tens of thousands of
    messages handed over at once is copied in one call that holds the GIL (0.1 s per 70,000)."""
    add = field.add
    for t in tensors:
        msg = add(name=t.name, shape=t.shape, dtype=t.dtype, offset=t.offset, nbytes=t.nbytes, checksum=t.checksum)
        if t.slice is not None:
            msg.slice.dim, msg.slice.start, msg.slice.stop = t.slice.dim, t.slice.start, t.slice.stop


def manifest_to_proto(m: Manifest, tensors: Iterable[ServedTensor] | None = None,
                      into: pb.Manifest | None = None) -> pb.Manifest:
    """The manifest as a message (written `into` one, if given), with all its tensors or only `tensors`."""
    msg = pb.Manifest() if into is None else into
    msg.MergeFrom(pb.Manifest(
        model=m.model, version=m.version, format=m.format, rounding=m.rounding, seed=m.seed,
        committed_unix=m.committed_unix, data_bytes=m.data_bytes, master_digest=m.master_digest, scaling=m.scaling,
        lag=lag_to_proto(m.lag), aliases=dict(m.aliases), tensor_count=len(m.tensors),
        parts=[pb.ManifestPart(owner=p.owner, offset=p.offset, nbytes=p.nbytes, holders=p.holders) for p in m.parts],
        adapter=None if m.adapter is None else adapter_to_proto(m.adapter)))
    _add_tensors(msg.tensors, m.tensors if tensors is None else tensors)
    return msg


def piece_starts(sizes: Iterable[int], limit: int) -> list[int]:
    """Where each piece of a list of items begins, so that a piece holds at most `limit` bytes of
    items (`sizes`: an upper bound of each one's encoding), or a single item."""
    starts, size = [0], 0
    for i, n in enumerate(sizes):
        if size + n > limit and i > starts[-1]:
            starts.append(i)
            size = 0
        size += n
    return starts


def _pieces(m: Manifest) -> tuple[list[int], list[bytes]]:
    """The manifest as serialized PullResponse messages of about MESSAGE_PIECE_BYTES each: the
    Manifest with the first tensors, then ManifestTensors; and the index of each one's first tensor."""
    starts = piece_starts((len(t.name) + len(t.checksum) + 16 * len(t.shape) + 48 for t in m.tensors),
                          MESSAGE_PIECE_BYTES)
    bounds = [*starts[1:], len(m.tensors)]
    first = pb.PullResponse()
    manifest_to_proto(m, m.tensors[: bounds[0]], into=first.manifest)
    pieces = [first.SerializeToString()]
    for a, b in zip(starts[1:], bounds[1:], strict=True):
        piece = pb.PullResponse()
        _add_tensors(piece.manifest_tensors.tensors, m.tensors[a:b])
        pieces.append(piece.SerializeToString())
    return starts, pieces


def manifest_pieces(m: Manifest) -> list[bytes]:
    """The Pull stream's first messages: the manifest in pieces (computed once per manifest object:
    a fleet pulls the same version; 0.3 s at 100,000 tensors, so call it off the event loop)."""
    return memo(m, "grpc-pieces", _pieces)[1]


def manifest_from(m: Manifest, tensors_from: int) -> pb.Manifest:
    """GetManifest's answer: the manifest with its tensors from `tensors_from` on, as many as one
    piece holds (the client asks again for the rest)."""
    starts = memo(m, "grpc-pieces", _pieces)[0]
    if not 0 <= tensors_from <= len(m.tensors):
        raise InvalidArgument(f"{subject(m.model, m.version)} has {len(m.tensors)} tensors: "
                              f"tensors_from {tensors_from} is out of range")
    i = bisect.bisect_right(starts, tensors_from) - 1
    end = starts[i + 1] if i + 1 < len(starts) else len(m.tensors)
    return manifest_to_proto(m, m.tensors[tensors_from:end])


def lag_to_proto(lag: LagMetrics | None) -> pb.LagMetrics | None:
    return None if lag is None else pb.LagMetrics(**lag.to_dict())


def _scalars(cls: type, msg: object, skip: tuple[str, ...] = ()) -> dict[str, object]:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name not in skip}


def lag_from_proto(msg: pb.Manifest | pb.VersionInfo) -> LagMetrics | None:
    if not msg.HasField("lag"):
        return None
    values = _scalars(LagMetrics, msg.lag)
    if not msg.lag.HasField("update_visibility"):
        values["update_visibility"] = None
    return LagMetrics(**values)  # type: ignore[arg-type]


def info_to_proto(m: Manifest, mismatch: RolloutMismatch | None = None, mismatch_step: int | None = None
                  ) -> pb.VersionInfo:
    """A version's short form; in listings, with the mismatch reported for it."""
    return pb.VersionInfo(**{**m.info(), "lag": lag_to_proto(m.lag)},
                          mismatch=None if mismatch is None else mismatch_to_proto(mismatch),
                          mismatch_step=mismatch_step)


def slice_from_proto(msg: pb.ServedTensor | pb.TensorSelect) -> Slice | None:
    return Slice(msg.slice.dim, msg.slice.start, msg.slice.stop) if msg.HasField("slice") else None


def select_to_proto(select: Select) -> list[pb.TensorSelect]:
    return [pb.TensorSelect(tensor=name, slice=None if cut is None else pb.TensorSlice(**dataclasses.asdict(cut)))
            for name, cut in select.items()]


def select_from_proto(items: Iterable[pb.TensorSelect]) -> dict[str, Slice | None]:
    return selection((item.tensor, slice_from_proto(item)) for item in items)


def manifest_from_proto(m: pb.Manifest, more: Iterable[pb.ServedTensor] = ()) -> Manifest:
    """A manifest from its message, and the tensors that came in later pieces (`more`)."""
    tensors = tuple(ServedTensor(t.name, tuple(t.shape), t.dtype, t.offset, t.nbytes, t.checksum,
                                 Slice(t.slice.dim, t.slice.start, t.slice.stop) if t.HasField("slice") else None)
                    for batch in (m.tensors, more) for t in batch)
    parts = tuple(Part(p.owner, p.offset, p.nbytes, tuple(p.holders)) for p in m.parts)
    return Manifest(m.model, m.version, m.format, m.rounding, m.seed, m.committed_unix, m.data_bytes,
                    m.master_digest, tensors, m.scaling, lag_from_proto(m), parts,
                    tuple(sorted(m.aliases.items())),
                    adapter=adapter_from_proto(m.adapter) if m.HasField("adapter") else None)


def adapter_to_proto(a: Adapter) -> pb.Adapter:
    return pb.Adapter(base_model=a.base_model, base_version=a.base_version, base_digest=a.base_digest, rank=a.rank,
                      alpha=a.alpha, target_modules=a.target_modules)


def adapter_from_proto(a: pb.Adapter) -> Adapter:
    return Adapter(a.base_model, a.rank, a.alpha, tuple(a.target_modules), a.base_version, a.base_digest)
