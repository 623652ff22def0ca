"""What happens on pull, for every transport: which bytes this replica sends, under which limits.

A `Pull` holds its version from `Service.pull` to `close` (eviction cannot recycle the buffer
meanwhile), picks what follows the manifest (the data section, or a delta against a version the
client holds), and sends each piece through the transport's own write under the stall timeout,
counted in the metrics. The transports only frame the pieces: gRPC as chunks of the data section
(or of the delta), HTTP as a range of the safetensors file (or the delta's bytes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightsvc.core.manifest import Manifest
from weightsvc.core.store import Version
from weightsvc.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable

if TYPE_CHECKING:
    from weightsvc.core.service import Service


class Pull:
    """One pull in progress. `body` is what follows the manifest: the bytes of the data section this
    replica holds (from `start`), or, when `base` is set, the delta encoding against that version."""

    def __init__(self, service: Service, version: Version, transport: str) -> None:
        self.service = service
        self.version = version
        self.transport = transport
        self.base: int | None = None
        self.body = version.data
        self.start = version.offset  # offset of body[0] in the data section

    @property
    def manifest(self) -> Manifest:
        return self.version.manifest

    def _where(self) -> str:
        return f"model {self.manifest.model!r} version {self.manifest.version}"

    def use_delta(self, base: int, delta: bytes) -> None:
        self.base, self.body, self.start = base, memoryview(delta), 0

    def chunks(self, offset: int, size: int) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) pieces of at most `size` bytes of the body from `offset` on (a resumed
        pull). A replica holding one part sends its part's bytes at or above `offset`, and nothing
        when asked for an offset outside its part: the manifest tells the client who holds the rest."""
        total = len(self.body) if self.base is not None else self.manifest.data_bytes
        if not 0 <= offset <= total:
            raise InvalidArgument(f"{self._where()}: resume offset {offset} is outside its {total}-byte "
                                  f"{'delta' if self.base is not None else 'data section'}")  # fmt: skip
        start, end = self.start, self.start + len(self.body)
        first = offset if start <= offset <= end else end
        return ((at, self.body[at - start : at - start + size]) for at in range(first, end, size))

    def file_pieces(self, start: int, end: int, size: int) -> Iterator[memoryview]:
        """Pieces of at most `size` bytes covering [start, end) of the version's safetensors file.

        A replica holding one part serves the header and its own part (contiguous with the header only
        for the first part); any other range is FAILED_PRECONDITION, naming the owners."""
        v = self.version
        head = len(v.header)
        lo, hi = (head + b for b in v.held)
        if v.part is not None and not (end <= head or (lo <= start and end <= hi) or (lo == head and end <= hi)):
            owners = ", ".join(f"{p.owner} [{p.offset}, {p.offset + p.nbytes})" for p in self.manifest.parts)
            raise FailedPrecondition(
                f"{self._where()} is sharded over replicas that each hold a part of its data section ({owners}); "
                f"this one serves its header ({head} bytes) and its own part by Range. The InferenceClient "
                "gathers the parts from their owners"
            )
        return v.file_range(start, end, size)

    def lend(self) -> None:
        """The transport may keep views of the body beyond this pull: never recycle the version's buffer
        (a delta's bytes are its own)."""
        if self.base is None:
            self.version.lent = True

    async def send(self, sending: Awaitable[None], nbytes: int = 0) -> None:
        """Await one write of the transport, `nbytes` of them version bytes. A write waits on flow
        control, so a client that stops reading would hold the version forever: the stall timeout
        takes it back (DEADLINE_EXCEEDED)."""
        stall = self.service.settings.pull_stall_timeout_s
        try:
            async with asyncio.timeout(stall):
                await sending
        except TimeoutError:
            raise DeadlineExceeded(
                f"{self._where()}: the client read nothing for {stall:g} s (--pull-stall-timeout-s); pull dropped",
                reason="stalled",
            ) from None
        if nbytes:
            self.service.count_pulled(self.manifest.model, self.transport, nbytes)

    def close(self) -> None:
        self.service.close_pull(self.version, self.transport)


@dataclass(frozen=True)
class ClientStatus:
    """An inference client as its acks describe it."""

    client_id: str
    version: int  # the version it acked last
    lag_versions: int  # committed versions newer than that one
    last_seen_unix: float
    connected: bool  # acked within the store's CLIENT_TIMEOUT_S; older clients count as gone


async def watching(
    events: AsyncIterator[Manifest], stopping: asyncio.Event, idle: float | None
) -> AsyncIterator[Manifest | None]:
    """`events`, with None after each `idle` seconds without one; ends with UNAVAILABLE once `stopping`
    is set, so that no watch holds up the server's shutdown."""
    stop = asyncio.ensure_future(stopping.wait())
    upcoming = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait((upcoming, stop), timeout=idle, return_when=asyncio.FIRST_COMPLETED)
            if upcoming in done:
                try:
                    manifest = upcoming.result()
                except StopAsyncIteration:
                    return
                yield manifest
                upcoming = asyncio.ensure_future(anext(events))
            elif stop in done:
                raise Unavailable("the server is stopping: watch again, after the last version received")
            else:
                yield None
    finally:
        stop.cancel()
        upcoming.cancel()  # a pending read ends the events with it
