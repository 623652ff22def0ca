"""The push stream of either transport as the core's messages: PushRequest messages (gRPC's, or
HTTP's body of gRPC-framed ones), and a safetensors file (HTTP's PUT)."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from typing import Any

from weightsvc._aio import BIG_MANIFEST, in_thread
from weightsvc.errors import InvalidArgument, ResourceExhausted, subject
from weightsvc.protocol.manifest import MASTER_DTYPE, TensorSpec
from weightsvc.protocol.safetensors import MAX_HEADER_BYTES, check_metadata, header_length, load_header, tensor_entry
from weightsvc.protocol.wire import ChunkView, Malformed, adapter_from_proto, decode_push_request
from weightsvc.service.api import PushChunk, PushCommit, PushHeader, PushMessage
from weightsvc.v1 import weightsvc_pb2 as pb

FRAME_PREFIX = 5  # gRPC's framing of a message: a flag byte (0: not compressed), a big-endian u32 length
BIG_FRAME = 1 << 20  # a message this large that is not a chunk (a piece of a big header) is decoded off the loop
FILE_CHUNK_BYTES = 1 << 20  # the bytes of a safetensors body handed to the core at once


async def push_messages(
    requests: AsyncIterator[pb.PushRequest | ChunkView | Malformed], max_tensors: int
) -> AsyncIterator[PushMessage]:
    it = aiter(requests)
    layout: _RankLayout | None = None
    async for req in it:
        if isinstance(req, ChunkView):  # the bulk path: views into the received message
            many = layout is not None and len(layout.order) >= BIG_MANIFEST  # one chunk may pack thousands
            yield await in_thread(many, _unpacked, layout, req.tensor, req.offset, req.data)
            continue
        if isinstance(req, Malformed):
            raise InvalidArgument(req.reason, reason="bad_chunk")
        kind = req.WhichOneof("kind")
        if kind == "chunk":
            yield _unpacked(layout, req.chunk.tensor, req.chunk.offset, memoryview(req.chunk.data))
        elif kind == "header":
            h = req.header
            where = subject(h.model, step=h.step)
            if h.tensor_count > max_tensors:
                raise ResourceExhausted(f"{where}: {h.tensor_count} tensors, more than the {max_tensors} a version "
                                        "may have (--max-tensors)", reason="too_large")
            pieces = [h.tensors]  # a big header comes in pieces: gather them first
            count = len(h.tensors)
            while count < h.tensor_count:
                more = await anext(it, None)
                if not (isinstance(more, pb.PushRequest) and more.WhichOneof("kind") == "tensors"):
                    raise InvalidArgument(f"{where}: the header declares {h.tensor_count} tensors, and its pieces "
                                          f"ended after {count}", reason="invalid_header")
                pieces.append(more.tensors.tensors)
                count += len(more.tensors.tensors)
            if h.tensor_count and count != h.tensor_count:
                raise InvalidArgument(f"{where}: the header declares {h.tensor_count} tensors, its pieces hold "
                                      f"{count}", reason="invalid_header")
            header, layout = await in_thread(count >= BIG_MANIFEST, _header, h, pieces)
            yield header
        elif kind == "commit":
            yield PushCommit()
        elif kind == "tensors":
            raise InvalidArgument("PushTensors must follow the header, before any chunk", reason="invalid_header")
        else:
            raise InvalidArgument("empty push message: set one of header, chunk, commit", reason="bad_chunk")


class _RankLayout:
    """The byte ranges a rank declared, in its header's order: where a packed chunk's bytes go."""

    def __init__(self, tensors: tuple[TensorSpec, ...]) -> None:
        self.order = [(t.name, t.elements[0] * 4, sum(t.elements) * 4) for t in tensors]
        self.index = {t.name: i for i, t in enumerate(tensors)}


def _unpacked(layout: _RankLayout | None, tensor: str, offset: int, data: memoryview) -> list[PushChunk]:
    """A chunk as the pieces of each tensor it holds: a chunk that runs past the end of its tensor's
    part goes on with the next tensors of the rank's header (many small tensors, few messages).
    One the header cannot place (an unknown tensor, an offset outside its part, bytes past the last
    tensor) is left whole: the push refuses it, saying why."""
    i = layout.index.get(tensor) if layout is not None and len(data) else None
    if layout is None or i is None or not offset < layout.order[i][2] < offset + len(data):
        return [PushChunk(tensor, offset, data)]  # within its tensor, or not ours to place
    pieces, rest = [], data
    for j in range(i, len(layout.order)):
        name, start, end = layout.order[j]
        at = offset if j == i else start
        take = rest[: end - at]
        if len(take):
            pieces.append(PushChunk(name, at, take))
            rest = rest[len(take) :]
        if not len(rest):
            return pieces
    return [PushChunk(tensor, offset, data)]


def _header(h: pb.PushHeader, pieces: list[Any]) -> tuple[PushHeader, _RankLayout]:
    """The header and its pieces of tensors as the core takes them, and the rank's layout (linear in
    the tensors: off the loop for a big header)."""
    tensors = tuple(TensorSpec(t.name, tuple(t.shape), t.dtype, _part(t.part) if t.HasField("part") else None)
                    for batch in pieces for t in batch)
    return PushHeader(
        model=h.model,
        step=h.step,
        tensors=tensors,
        format=h.format,
        rounding=h.rounding,
        rank=h.rank,
        world_size=h.world_size or 1,
        owners=tuple(h.owners),
        replication=max(1, h.replication),
        aliases=tuple(sorted(h.aliases.items())),
        adapter=adapter_from_proto(h.adapter) if h.HasField("adapter") else None,
    ), _RankLayout(tensors)


def _part(part: pb.TensorPart) -> tuple[int, int]:
    return part.offset, part.count


class Received:
    """The pieces of a request body as they arrive, taken in spans: a span within one piece is a view
    of it, one across pieces is joined once."""

    def __init__(self, pieces: AsyncIterator[bytes]) -> None:
        self._pieces = aiter(pieces)
        self._held: collections.deque[memoryview] = collections.deque()
        self.size = 0  # bytes held
        self.taken = 0  # bytes taken so far

    async def fill(self, n: int) -> bool:
        """Hold at least `n` bytes; False if the body ends before."""
        while self.size < n:
            piece = await anext(self._pieces, None)
            if piece is None:
                return False
            if piece:
                self._held.append(memoryview(piece))
                self.size += len(piece)
        return True

    def take(self, n: int) -> memoryview | bytes:
        if not n:
            return b""  # (an empty frame, or header, may come when nothing more is held)
        first = self._held[0]
        if len(first) >= n:
            span: memoryview | bytes = first[:n]
            if len(first) == n:
                self._held.popleft()
            else:
                self._held[0] = first[n:]
        else:
            parts, left = [], n
            while left:
                piece = self._held.popleft()
                if len(piece) > left:
                    self._held.appendleft(piece[left:])
                    piece = piece[:left]
                parts.append(piece)
                left -= len(piece)
            span = b"".join(parts)
        self.size -= n
        self.taken += n
        return span


async def framed_requests(body: Received, max_message_bytes: int
                          ) -> AsyncIterator[pb.PushRequest | ChunkView | Malformed]:
    """The PushRequest messages of a body of gRPC-framed ones, decoded as they arrive (chunks as
    views of the body). A frame over `max_message_bytes` is refused before it is read."""
    while await body.fill(FRAME_PREFIX):
        prefix = bytes(body.take(FRAME_PREFIX))
        at = body.taken - FRAME_PREFIX
        n = int.from_bytes(prefix[1:], "big")
        if prefix[0] != 0:
            raise InvalidArgument(f"the frame at byte {at} of the body is compressed (flag {prefix[0]}); send "
                                  "uncompressed messages", reason="bad_chunk")
        if n > max_message_bytes:
            raise ResourceExhausted(f"the frame at byte {at} of the body holds a message of {n} bytes, more than "
                                    f"the {max_message_bytes} this server takes (--max-message-bytes)",
                                    reason="too_large")
        if not await body.fill(n):
            raise InvalidArgument(f"the body ended inside the frame at byte {at} ({body.size} of its {n} bytes "
                                  "came)", reason="aborted")
        raw = body.take(n)
        message = await in_thread(n >= BIG_FRAME and raw[:1] != b"\x12", decode_push_request, raw)
        if isinstance(message, pb.PushRequest) and message.WhichOneof("kind") == "commit" and await body.fill(1):
            raise InvalidArgument(f"the body goes on past its commit frame (at byte {at}): the commit ends a push",
                                  reason="bad_chunk")
        yield message


async def file_messages(body: Received, model: str, step: int, format: str, rounding: str
                        ) -> AsyncIterator[PushMessage]:
    """A safetensors file of F32 tensors as one rank's push: its header, its data section as chunks
    (tensors in data order), and the commit once the body has ended at the end of the data."""
    where = subject(model, step=step)
    if not await body.fill(8):
        raise InvalidArgument(f"{where}: the body is not a safetensors file: shorter than 8 bytes")
    n = header_length(body.take(8))
    if n > MAX_HEADER_BYTES:
        raise InvalidArgument(f"{where}: the safetensors header length {n} is over {MAX_HEADER_BYTES} bytes")
    if not await body.fill(n):
        raise InvalidArgument(f"{where}: the body ended inside the safetensors header ({body.size} of {n} bytes)")
    raw = bytes(body.take(n))
    tensors = await in_thread(n >= BIG_FRAME, _file_tensors, raw, model, step)
    yield PushHeader(model=model, step=step, tensors=tensors, format=format, rounding=rounding)
    data = body.taken
    for spec in tensors:
        sent, size = 0, 4 * spec.numel
        while sent < size:
            take = min(size - sent, FILE_CHUNK_BYTES)
            if not await body.fill(take):
                return  # ended early: the core aborts the push, nothing is visible
            yield [PushChunk(spec.name, sent, body.take(take))]
            sent += take
    if await body.fill(1):
        raise InvalidArgument(f"{where}: the body goes on past the end of the safetensors data section "
                              f"({body.taken - data} bytes)", reason="bad_chunk")
    yield PushCommit()


def _file_tensors(raw: bytes, model: str, step: int) -> tuple[TensorSpec, ...]:
    """The tensors of a safetensors header in data order, each with its size: F32 only, laid end to end."""
    where = subject(model, step=step)
    try:
        header = load_header(raw)
        check_metadata(header.pop("__metadata__", {}))
    except ValueError as e:
        raise InvalidArgument(f"{where}: the safetensors header cannot be read: {e}", reason="invalid_header") from None
    entries: list[tuple[int, int, TensorSpec]] = []
    for name, t in header.items():
        try:
            dtype, shape, begin, end = tensor_entry(t)
        except ValueError as e:
            raise InvalidArgument(f"{subject(model, step=step, tensor=name)}: {e}", reason="invalid_header") from None
        if dtype != "F32":
            raise InvalidArgument(f"{where}: tensor {name!r} is {dtype}; push F32 masters (a file of another "
                                  "dtype: convert it, or push it with LearnerClient, which widens BF16/F16)",
                                  reason="invalid_header")
        entries.append((begin, end, TensorSpec(name, shape, MASTER_DTYPE, None)))
    entries.sort(key=lambda e: e[0])
    at = 0
    for begin, end, spec in entries:
        if begin != at or end - begin != 4 * spec.numel:
            raise InvalidArgument(f"{where}: tensor {spec.name!r}: data_offsets [{begin}, {end}) are not the "
                                  f"{4 * spec.numel} bytes of its shape {list(spec.shape)} right after the previous "
                                  f"tensor (at {at})", reason="invalid_header")
        at = end
    return tuple(spec for _, _, spec in entries)
