"""What happens on pull, for every transport: which bytes this replica sends, under which limits.

`Pulls` admits a pull (--max-pulls), holds its version (eviction cannot recycle the buffer until the
pull ends) and decides what follows the manifest: the data section, the delta encoding against a
version the client holds (encoded once for a fleet), or the selection the client asked for
(`protocol.selection`: the tensors it names, whole or sliced, under a manifest of their own). A `Pull`
sends each piece through the transport's own write under the stall timeout, counted in the
metrics. The transports only frame the pieces: gRPC as chunks of the data section (or of the delta
or the selection), HTTP as a range of the safetensors file (or of the selection's file, or the
delta's bytes). A watch follows the registry's events (`events`) and ends when the server stops
(`watching`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from weightsvc.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TooManyRequests,
    Unavailable,
    subject,
)
from weightsvc.metrics import Metrics
from weightsvc.protocol import selection
from weightsvc.protocol.delta import compatible as delta_compatible
from weightsvc.protocol.delta import encode as delta_encode
from weightsvc.protocol.manifest import Manifest, Slice
from weightsvc.protocol.selection import Select, Selected
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.replicas.registry import Registry
from weightsvc.service.versions.index import FileRange, Version, VersionIndex
from weightsvc.settings import Settings

MAX_CACHED_DELTAS = 2  # each up to the size of its version: a fleet pulls (latest, its base)
MAX_CACHED_SELECTIONS = 16  # manifests of lent selections: a fleet's tensor-parallel ranks ask the same few
DELTA_BASE = "delta"  # the "transport" of a base held while a delta is encoded: not a pull of its own


class Pulls:
    """The pulls of this server: how many are in progress, and the recent delta encodings."""

    def __init__(self, settings: Settings, metrics: Metrics, index: VersionIndex, parts: Parts,
                 changed: Callable[[], None]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.index = index
        self.parts = parts  # this replica's id, for the parts of a selection it holds
        self.changed = changed  # a pull ended
        self.in_flight = 0  # pulls holding a version, against --max-pulls
        self._deltas: dict[tuple[str, int, int], bytes | None] = {}  # oldest first; None: not smaller
        self._selected: dict[tuple[str, int, str, tuple[tuple[str, Slice | None], ...]], Manifest] = {}  # oldest first

    async def open(self, model: str, version: int | None, transport: str, *, base: int | None = None,
                   dense_fallback: bool = True, select: Select | None = None, in_place: bool = False) -> Pull:
        """Start a pull of `version` (None: the latest). With `base` (a version the client holds), the
        body is the delta encoding against it when there is one; when there is none, the data section
        as always, or without `dense_fallback` FAILED_PRECONDITION saying why (the client then pulls
        the whole version). With `select`, only the selected tensors, whole or sliced, under the
        selection's own manifest (never as a delta); `in_place` (a transport that reads the version's
        own memory through `pieces`) gathers no bytes: the selection's manifest only, computed once."""
        if select is not None and base is not None:
            raise InvalidArgument(f"model {model!r}: a selection cannot be pulled as a delta (base {base}): "
                                  "sliced pulls are sent dense; pull the selection without a base")
        pull = Pull(self, self.hold(model, version, transport), transport)
        try:
            if select is not None and in_place:
                pull.selected = await self.selected(pull.version, select)
            elif select is not None:
                v = pull.version
                pull.selection = await asyncio.to_thread(
                    selection.gather, v.manifest, v.data, v.spans, select, self.parts.replica_id
                )
            elif base is not None:
                try:
                    pull.use_delta(base, await self.delta(pull.version, base))
                except FailedPrecondition:
                    if not dense_fallback:
                        raise
        except BaseException:
            pull.close()
            raise
        return pull

    def hold(self, model: str, version: int | None, transport: str) -> Version:
        """Hold a version for a pull; eviction cannot recycle its buffer until `release`."""
        pull = transport != DELTA_BASE
        if pull and self.in_flight >= self.settings.max_pulls:
            raise TooManyRequests(
                f"{self.in_flight} pulls in progress, the most this server takes (--max-pulls "
                f"{self.settings.max_pulls}); retry later",
                reason="too_many",
            )
        held = self.index.get(model, version)
        self.index.hold(held)
        self.in_flight += pull
        self.metrics.pulls_in_flight.labels(transport).inc()
        return held

    def release(self, version: Version, transport: str) -> None:
        self.metrics.pulls_in_flight.labels(transport).dec()
        self.in_flight -= transport != DELTA_BASE
        self.index.release(version)
        self.changed()

    async def selected(self, version: Version, select: Select) -> Manifest:
        """The manifest of the selection `select` of `version` (its slices' checksums hashed once per
        version and selection: each reader of a rank's slices asks the same)."""
        m = version.manifest
        key = (m.model, m.version, version.etag, tuple(select.items()))
        if key in self._selected:
            return self._selected[key]
        picked = await asyncio.to_thread(selection.gather, m, version.data, version.spans, select,
                                         self.parts.replica_id)
        self._selected[key] = picked.manifest  # (the bytes it gathered go: a reader reads them in place)
        while len(self._selected) > MAX_CACHED_SELECTIONS:
            self._selected.pop(next(iter(self._selected)))
        return picked.manifest

    async def delta(self, version: Version, base: int) -> bytes:
        """The delta encoding of `version` against `base` of the same model. FAILED_PRECONDITION, saying
        why, when there is none: the base is the version itself or not retained, either is sharded over
        replicas, their layouts differ, or the delta would not be smaller than the dense bytes."""
        m = version.manifest

        def none(why: str) -> FailedPrecondition:
            return FailedPrecondition(f"{subject(m.model, m.version)}: no delta against base {base}: {why}; "
                                      "pull the whole version")

        not_smaller = f"it would not be smaller than the {m.data_bytes} dense bytes"
        key = (m.model, m.version, base)
        if key in self._deltas:  # a fleet pulls the same delta many times: encode it once
            cached = self._deltas[key]
            if cached is None:
                raise none(not_smaller)
            return cached
        if base == m.version:
            raise none("that is the version itself")
        if version.part is not None:
            raise none("the version is sharded over replicas")
        try:
            held = self.hold(m.model, base, DELTA_BASE)
        except NotFound as e:
            raise none(e.message) from None
        try:
            if held.part is not None:
                raise none("the base is sharded over replicas")
            if not delta_compatible(held.manifest, m):
                raise none("the base has other tensors, shapes or dtypes")
            encoded = await asyncio.to_thread(delta_encode, m, version.data, held.data)
        finally:
            self.release(held, DELTA_BASE)
        delta = encoded if len(encoded) < m.data_bytes else None
        self._deltas[key] = delta
        while len(self._deltas) > MAX_CACHED_DELTAS:
            self._deltas.pop(next(iter(self._deltas)))
        if delta is None:
            raise none(not_smaller)
        return delta


class Pull:
    """One pull in progress. `body` is what follows the manifest: the bytes of the data section this
    replica holds (from `start`), or, when `base` is set, the delta encoding against that version.
    With a `selection`, the manifest and the bytes are the selection's.

    Where those bytes lie is asked of the pull, by every transport alike: `chunks` by offset in the
    body, `file_pieces` by offset in the safetensors file, `pieces` by tensor and slice, each piece a
    view of memory or a `FileRange` of the version's file (`api.Piece`); a transport only frames and
    sends them (or registers them, to be read in place)."""

    def __init__(self, pulls: Pulls, version: Version, transport: str) -> None:
        self.pulls = pulls
        self.version = version
        self.transport = transport
        self.base: int | None = None
        self.body = version.data  # (a delta's bytes, when `base` is set)
        self.selection: Selected | None = None
        self.selected: Manifest | None = None  # an in-place selection's manifest (its bytes are the version's)
        self.closed = False

    @property
    def manifest(self) -> Manifest:
        """The manifest the client gets: the version's, or the selection's."""
        if self.selection is not None:
            return self.selection.manifest
        return self.version.manifest if self.selected is None else self.selected

    @property
    def etag(self) -> str:
        """The HTTP entity tag of the file this pull serves (the version's, or the selection's)."""
        return self.version.etag if self.selection is None else self.selection.etag

    @property
    def file_size(self) -> int:
        return self.version.size if self.selection is None else self.selection.size

    def _where(self) -> str:
        return subject(self.manifest.model, self.manifest.version)

    def use_delta(self, base: int, delta: bytes) -> None:
        self.base, self.body = base, memoryview(delta)

    def chunks(self, offset: int, size: int) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) pieces of at most `size` bytes of the body from `offset` on (a resumed
        pull). A replica holding parts sends the bytes of the part that holds `offset`, from there to
        its end, and nothing when it holds no part there: the manifest tells the client who does."""
        total = len(self.body) if self.base is not None else self.manifest.data_bytes
        if not 0 <= offset <= total:
            raise InvalidArgument(f"{self._where()}: resume offset {offset} is outside its {total}-byte "
                                  f"{'delta' if self.base is not None else 'data section'}")
        if self.selection is not None:
            return self.selection.chunks(offset, size)
        if self.base is not None:
            return ((at, self.body[at : at + size]) for at in range(offset, total, size))
        held = self.version.span(offset, offset + 1)
        if held is None:
            return iter(())
        end, skip = held.start + held.nbytes, held.start - held.local
        return ((at, self.body[at - skip : min(end, at + size) - skip]) for at in range(offset, end, size))

    def file_pieces(self, start: int, end: int, size: int, zero_copy: bool = False) -> Iterator[memoryview | FileRange]:
        """Pieces of at most `size` bytes covering [start, end) of the version's safetensors file; with
        `zero_copy`, what lies in a file comes as ranges of it (`Version.file_range`).

        A replica holding one part serves the header and its own part (contiguous with the header only
        for the first part); any other range is FAILED_PRECONDITION, naming the owners."""
        if self.selection is not None:
            return self.selection.file_range(start, end, size)
        v = self.version
        head = len(v.header)
        held = v.span(max(start, head) - head, max(end, head) - head)
        if v.part is not None and not (end <= head or (held is not None and (start >= head or held.start == 0))):
            owners = ", ".join(f"{'/'.join(p.sources)} [{p.offset}, {p.offset + p.nbytes})"
                               for p in self.manifest.parts)
            raise FailedPrecondition(
                f"{self._where()} is sharded over replicas that each hold a part of its data section ({owners}); "
                f"this one serves its header ({head} bytes) and its own part by Range. The InferenceClient "
                "gathers the parts from their owners"
            )
        return v.file_range(start, end, size, zero_copy)

    def pieces(self, name: str, cut: Slice | None = None, zero_copy: bool = False) -> list[memoryview | FileRange]:
        """Where the bytes of tensor `name` of the pulled version, or of its slice `cut`, lie on this
        server (`Version.pieces`: as few pieces as the layout allows). They are the version's, even in a
        selection pull, and held against eviction until this pull closes."""
        return self.version.pieces(name, cut, zero_copy=zero_copy)

    def keep_buffer(self) -> None:
        """The transport may keep views of the body beyond this pull: never recycle the version's buffer
        (a delta's bytes are its own)."""
        if self.base is None:
            self.version.shared_views = True

    async def send(self, sending: Awaitable[None], nbytes: int = 0) -> None:
        """Await one write of the transport, `nbytes` of them version bytes. A write waits on flow
        control, so a client that stops reading would hold the version forever: the stall timeout
        takes it back (DEADLINE_EXCEEDED)."""
        stall = self.pulls.settings.pull_stall_timeout_s
        try:
            async with asyncio.timeout(stall):
                await sending
        except TimeoutError:
            raise DeadlineExceeded(
                f"{self._where()}: the client read nothing for {stall:g} s (--pull-stall-timeout-s); pull dropped",
                reason="stalled",
            ) from None
        if nbytes:
            self.pulls.metrics.pull_bytes.labels(self.manifest.model, self.transport).inc(nbytes)

    def close(self) -> None:
        """Let go of the version (once: the transports close on every way out)."""
        if not self.closed:
            self.closed = True
            self.pulls.release(self.version, self.transport)


async def events(registry: Registry, index: VersionIndex, model: str, after: int | None) -> AsyncIterator[Manifest]:
    """Every retained version above `after` (all when None), then each new one as it commits."""
    async for v in registry.events(model, -1 if after is None else after):
        version = await index.shown(model, v)
        if version is not None:  # else already evicted: a newer one follows
            yield version.manifest


class Watches:
    """The watch streams open, on every transport, bounded (`Settings.watch_limit`): a fleet of
    watchers must not take every connection the server has. One more ends the oldest with
    UNAVAILABLE; its client watches again after the last version it received, and misses nothing."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self.stopping = asyncio.Event()  # set when the server stops: every watch ends
        self._open: dict[object, asyncio.Event] = {}  # in the order they opened: the oldest first

    def __len__(self) -> int:
        return len(self._open)

    async def follow(self, events: AsyncIterator[Manifest], idle: float | None) -> AsyncIterator[Manifest | None]:
        """`events` as `watching` gives them, while this watch is among the newest `limit`."""
        key, evicted = object(), asyncio.Event()
        self._open[key] = evicted
        while len(self._open) > self.limit:
            self._open.pop(next(iter(self._open))).set()
            self.metrics.watches_evicted.inc()
        self.metrics.watches.set(len(self._open))
        try:
            async for manifest in watching(events, (self.stopping, evicted), idle):
                yield manifest
        finally:
            self._open.pop(key, None)
            self.metrics.watches.set(len(self._open))


async def watching(
    events: AsyncIterator[Manifest], ends: tuple[asyncio.Event, asyncio.Event], idle: float | None
) -> AsyncIterator[Manifest | None]:
    """`events`, with None after each `idle` seconds without one; ends with UNAVAILABLE once the server
    stops (`ends[0]`, so that no watch holds up its shutdown) or a newer watch takes its place (`ends[1]`)."""
    stopping, evicted = ends
    stop = asyncio.ensure_future(stopping.wait())
    evict = asyncio.ensure_future(evicted.wait())
    upcoming = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait((upcoming, stop, evict), timeout=idle, return_when=asyncio.FIRST_COMPLETED)
            if upcoming in done:
                try:
                    manifest = upcoming.result()
                except StopAsyncIteration:
                    return
                yield manifest
                upcoming = asyncio.ensure_future(anext(events))
            elif stop in done:
                raise Unavailable("the server is stopping: watch again, after the last version received")
            elif evict in done:
                raise Unavailable("more watch streams than this server keeps (--max-watches): this one, the oldest, "
                                  "ends; watch again, after the last version received")
            else:
                yield None
    finally:
        stop.cancel()
        evict.cancel()
        upcoming.cancel()  # a pending read ends the events with it
