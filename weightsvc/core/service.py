"""The transport-agnostic core: what happens on push, pull, list, watch and ack.

The gRPC servicer and the HTTP routes translate their requests into these calls and the domain
errors back; nothing about versions, export or metrics lives in them.

A push is staged privately: the served copy is laid out as one data section from the header(s),
master bytes are exported into their slots as they arrive (in a worker thread, overlapping the
receipt of the next chunks), and only `commit` makes the version visible. If a stream breaks, times
out or is rejected, the staging buffers are dropped and nothing is visible. Several learner ranks
may push one version together (`_ranks`): they share one session.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import overload

import numpy as np
import xxhash

from weightsvc import rounding
from weightsvc.core.delta import compatible as delta_compatible
from weightsvc.core.delta import encode as delta_encode
from weightsvc.core.lag import Sample, sample_stride, sampled_indices
from weightsvc.core.manifest import (
    DTYPE_SIZES,
    MASTER_DTYPE,
    Manifest,
    MasterDigest,
    ServedTensor,
    TensorSpec,
    check_model_name,
    checksum,
    layout,
)
from weightsvc.core.memory import alloc, resident_bytes
from weightsvc.core.pull import ClientStatus, Pull, watching
from weightsvc.core.ranks import MAX_WORLD_SIZE, RankGroup, merge_parts
from weightsvc.core.registry import MemoryRegistry, RedisRegistry
from weightsvc.core.store import CLIENT_TIMEOUT_S, PartOf, Version, VersionStore
from weightsvc.core.topology import Replica
from weightsvc.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TooManyRequests,
    Unavailable,
    WeightsvcError,
)
from weightsvc.metrics import Metrics
from weightsvc.settings import Settings

log = logging.getLogger("weightsvc.service")

MAX_NAME_CHARS = 1024
# Chunks received but not yet exported, per push: bounds staging memory, and pushes back on the
# learner (gRPC flow control) when export is slower than the network.
MAX_PENDING_CHUNKS = 8
MASTER_ITEMSIZE = DTYPE_SIZES[MASTER_DTYPE]
RESERVED_NAME = "__metadata__"
MAX_CACHED_DELTAS = 2  # each up to the size of its version: a fleet pulls (latest, its base)


@dataclass(frozen=True)
class PushHeader:
    model: str
    step: int
    tensors: tuple[TensorSpec, ...]
    format: str = ""  # per-push override of the server's export; empty: the server's
    rounding: str = ""
    rank: int = 0  # this learner rank, of world_size ranks that push the version together
    world_size: int = 1
    owners: tuple[str, ...] = ()  # sharded replicas: the ids of every replica that holds a part


@dataclass(frozen=True)
class PushChunk:
    tensor: str
    offset: int
    data: bytes | memoryview


@dataclass(frozen=True)
class PushCommit:
    pass


PushMessage = PushHeader | PushChunk | PushCommit


class _StagedTensor:
    def __init__(self, spec: TensorSpec, fmt: rounding.Format, slot: ServedTensor, scale: ServedTensor | None):
        self.spec = spec
        self.fmt = fmt
        self.slot = slot
        self.scale = scale  # the `<name>_scale_inv` slot of an fp8 tensor
        self.nbytes = spec.numel * DTYPE_SIZES[spec.dtype]
        self.received = 0  # bytes accepted on the loop, from all ranks
        # Filled by the export worker, chunk by chunk, in arrival order:
        self.exported = 0  # bytes exported (bf16/fp16) or gathered (fp8)
        self.master: np.ndarray | None = None  # fp8 only: scales need the whole tensor first
        self.new_residual: np.ndarray | None = None  # ef: this version's residual
        self.master_digest = MasterDigest(self.nbytes)
        self.nonfinite = 0
        self.saturated = 0
        self.checksums: dict[str, str] = {}
        # first element of a chunk -> its sampled (master, served, bits)
        self.samples: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


class _Part:
    """The bytes [start, end) of a tensor that one rank pushes, in order."""

    def __init__(self, tensor: _StagedTensor, start: int, end: int) -> None:
        self.tensor = tensor
        self.start = start
        self.end = end
        self.received = start


@dataclass(frozen=True)
class ModelSummary:
    model: str
    latest_version: int
    versions: list[int]  # retained, oldest first


class _Changes:
    """Wakes coroutines that wait for the service's state to change; notified from the loop."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.add(waiter)
            await waiter


class PushSession:
    """One learner's push, from header to commit. Owns its staging memory until it ends.

    bf16/fp16 export is elementwise with the flat element index as a key, so each chunk is
    exported into its slot of the data section as it arrives and the master is never assembled.
    fp8 tensors need their scales first: their chunks are gathered and exported once complete.
    With `ef`, the residual of the latest committed version is read and a new one written; it
    replaces the model's residual only if this version commits.
    """

    def __init__(self, service: Service, header: PushHeader, spec: rounding.ExportSpec, data: memoryview,
                 data_bytes: int, tensors: dict[str, _StagedTensor],
                 ranks: dict[int, tuple[TensorSpec, ...]]) -> None:  # fmt: skip
        self.service = service
        self.header = header
        self.spec = spec
        self.data = data
        self.data_bytes = data_bytes
        self.tensors = tensors
        self.parts = {
            rank: {p.name: _Part(tensors[p.name], p.elements[0] * MASTER_ITEMSIZE, sum(p.elements) * MASTER_ITEMSIZE)
                   for p in specs}
            for rank, specs in ranks.items()
        }  # fmt: skip
        self.residual = (
            service.store.residual(header.model, spec.format, spec.scaling) if spec.rounding == "ef" else None
        )
        self.base_version = service.store.latest(header.model)  # an ef push continues from this one
        # Sharded replicas: this push is this replica's part of the version.
        timeout = service.settings.push_rank_timeout_s
        self.part_of = PartOf(header.owners, timeout) if header.owners else None
        self.stride = sample_stride(sum(t.spec.numel for t in tensors.values()))
        self.staged_bytes = 0
        self._stage(data_bytes)
        self.pending: collections.deque[asyncio.Future[None]] = collections.deque()
        self.committed = False
        self.reserved = 0  # of the service's staging budget, returned when the session closes
        self.export_seconds = 0.0
        for t in self.tensors.values():
            if t.nbytes == 0:
                self._start(self._export_whole if t.fmt.scaled else self._export_chunk, t, 0, b"")

    @classmethod
    async def open(cls, service: Service, header: PushHeader, ranks: dict[int, tuple[TensorSpec, ...]]) -> PushSession:
        """Stage the version that `header` declares (whole tensors); `ranks` holds each rank's parts."""
        s = service.settings
        where = f"model {header.model!r} step {header.step}"
        try:
            spec = rounding.ExportSpec(header.format or s.format, header.rounding or s.rounding, s.seed, s.scaling,
                                       s.fp8_pattern)  # fmt: skip
        except ValueError as e:
            raise InvalidArgument(f"{where}: {e}", reason="invalid_header") from None
        entries, fmts = [], {}
        for t in header.tensors:
            fmt = fmts[t.name] = spec.format_for(t.name, t.shape)
            entries.append((t.name, t.shape, fmt.safetensors_dtype))
            if fmt.scaled:
                entries.append((t.name + rounding.SCALE_SUFFIX, scale_shape(t.shape, spec.scaling), "F32"))
        names = [e[0] for e in entries]
        if len(set(names)) != len(names):
            clash = next(n for n in names if names.count(n) > 1)
            raise InvalidArgument(f"{where}: tensor {clash!r} clashes with the scales of an fp8 tensor",
                                  reason="invalid_header")  # fmt: skip
        slots_list, data_bytes = layout(entries)
        slots = {slot.name: slot for slot in slots_list}
        tensors = {
            t.name: _StagedTensor(t, fmts[t.name], slots[t.name], slots.get(t.name + rounding.SCALE_SUFFIX))
            for t in header.tensors
        }
        data = service.store.pool.take(data_bytes)
        if data is None:
            data = await asyncio.to_thread(alloc, data_bytes)  # mapping pages takes a while: off the loop
        return cls(service, header, spec, data, data_bytes, tensors, ranks)

    def _where(self, rank: int | None = None) -> str:
        where = f"model {self.header.model!r} step {self.header.step}"
        return where if rank is None or len(self.parts) == 1 else f"{where} rank {rank}"

    def check_rank_complete(self, rank: int) -> None:
        missing = [p for p in self.parts[rank].values() if p.received < p.end]
        if missing:
            shown = [f"{p.tensor.spec.name!r} has {p.received - p.start} of {p.end - p.start} bytes"
                     for p in missing[:5]]  # fmt: skip
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise InvalidArgument(
                f"{self._where(rank)}: commit of an incomplete push: {'; '.join(shown)}{more}", reason="incomplete"
            )

    async def add_chunk(self, rank: int, chunk: PushChunk) -> None:
        where = self._where(rank)
        part = self.parts[rank].get(chunk.tensor)
        if part is None:
            raise InvalidArgument(f"{where}: chunk for undeclared tensor {chunk.tensor!r}", reason="bad_chunk")
        t = part.tensor
        if chunk.offset != part.received:
            raise InvalidArgument(
                f"{where}: tensor {t.spec.name!r}: chunk at byte offset {chunk.offset}, expected "
                f"{part.received} (the chunks of a tensor or part arrive in order, without gaps or overlaps)",
                reason="bad_chunk",
            )
        n = len(chunk.data)
        if part.received + n > part.end:
            whole = part.end - part.start == t.nbytes
            raise InvalidArgument(
                f"{where}: tensor {t.spec.name!r}: "
                + (f"{part.received + n} bytes received, more than its declared shape {list(t.spec.shape)} of "
                   f"{t.spec.dtype} holds ({t.nbytes} bytes)" if whole else
                   f"a chunk ends at byte {part.received + n}, beyond the part this rank declared "
                   f"(bytes [{part.start}, {part.end}))"),
                reason="bad_chunk",
            )  # fmt: skip
        if n % MASTER_ITEMSIZE:
            raise InvalidArgument(
                f"{where}: tensor {t.spec.name!r}: a chunk of {n} bytes splits an element "
                f"(chunks carry whole {MASTER_DTYPE} elements of {MASTER_ITEMSIZE} bytes)",
                reason="bad_chunk",
            )
        first = t.received == 0
        part.received += n
        t.received += n
        self.service.metrics.push_bytes.labels(self.header.model).inc(n)
        if first and self.residual is not None:
            self._stage(t.nbytes)  # the new residual of this tensor
        if t.fmt.scaled:
            if first:
                self._stage(t.nbytes)  # the gathered master
            self._start(self._gather_chunk, t, chunk.offset, chunk.data)
            if t.received == t.nbytes:
                self._start(self._export_whole, t, 0, b"")
        else:
            self._start(self._export_chunk, t, chunk.offset, chunk.data)
        while self.pending and self.pending[0].done():
            self.pending.popleft().result()
        if len(self.pending) > MAX_PENDING_CHUNKS:
            # Shielded: the ranks of a push share these futures, and a rank whose stream is cancelled
            # must not cancel the export another rank waits on.
            await asyncio.shield(self.pending[0])

    def _start(self, job: Callable[[_StagedTensor, int, bytes | memoryview], None], t: _StagedTensor,
               byte_offset: int, data: bytes | memoryview) -> None:  # fmt: skip
        """Queue work for the export thread: one thread, so a tensor's chunks are handled in order."""
        n = len(data)
        self._stage(n)
        fut = asyncio.get_running_loop().run_in_executor(self.service.executor, job, t, byte_offset, data)
        fut.add_done_callback(lambda _f: self._stage(-n))
        self.pending.append(fut)

    def _stage(self, nbytes: int) -> None:
        self.staged_bytes += nbytes
        self.service.metrics.staged_bytes.inc(nbytes)

    def _residuals(self, t: _StagedTensor) -> tuple[np.ndarray | None, np.ndarray | None]:
        if self.residual is None:
            return None, None
        if t.new_residual is None:
            t.new_residual = np.empty(t.spec.numel, np.float32)
        return self.residual.tensor(t.spec.name, t.spec.numel), t.new_residual

    def _slot_bytes(self, slot: ServedTensor) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.uint8, count=slot.nbytes, offset=slot.offset)

    def _export_chunk(self, t: _StagedTensor, byte_offset: int, data: bytes | memoryview) -> None:
        """Worker thread: Fair Cast one chunk into the tensor's slot (bf16/fp16)."""
        start = time.perf_counter()
        master = np.frombuffer(data, dtype=np.float32)
        served = self._slot_bytes(t.slot)
        first, count, size = byte_offset // MASTER_ITEMSIZE, master.size, t.fmt.itemsize
        res_in, res_out = self._residuals(t)
        stats = rounding.export_array(
            master, served[first * size : (first + count) * size], self.spec, version=self.header.step,
            name=t.spec.name, fmt=t.fmt, offset=first,
            residual=None if res_in is None else res_in[first : first + count],
            new_residual=None if res_out is None else res_out[first : first + count],
        )  # fmt: skip
        t.master_digest.update(byte_offset, data)
        t.nonfinite += stats.nonfinite
        t.saturated += stats.saturated
        start = -first % self.stride  # the sampled elements of this chunk, as strided views
        if start < count:
            codes = served[first * size : (first + count) * size].view(np.uint16 if size == 2 else np.uint8)
            codes = codes[start :: self.stride]
            t.samples[first] = (master[start :: self.stride].copy(), rounding.decode(codes, t.fmt),
                                codes.astype(np.uint32))  # fmt: skip
        t.exported += len(data)
        if t.exported == t.nbytes:  # the last chunk of the tensor, from whichever rank
            t.checksums[t.slot.name] = checksum(served)
        self.export_seconds += time.perf_counter() - start

    def _gather_chunk(self, t: _StagedTensor, byte_offset: int, data: bytes | memoryview) -> None:
        """Worker thread: copy a chunk of an fp8 tensor into its gathered master."""
        if t.master is None:
            t.master = np.empty(t.spec.numel, np.float32)
        t.master.view(np.uint8)[byte_offset : byte_offset + len(data)] = np.frombuffer(data, np.uint8)
        t.master_digest.update(byte_offset, data)

    def _export_whole(self, t: _StagedTensor, _offset: int, _data: bytes | memoryview) -> None:
        """Worker thread: scales from the whole tensor, then Fair Cast it and serve the scales."""
        start = time.perf_counter()
        master = t.master if t.master is not None else np.empty(0, np.float32)
        res_in, res_out = self._residuals(t)
        values = master if res_in is None else master + res_in  # EF quantizes m + e
        scales = rounding.fp8_scales(values.reshape(t.spec.shape), t.fmt, self.spec.scaling)
        served = self._slot_bytes(t.slot)
        stats = rounding.export_array(
            master, served, self.spec, version=self.header.step, name=t.spec.name, fmt=t.fmt, scales=scales,
            residual=res_in, new_residual=res_out,
        )  # fmt: skip
        assert t.scale is not None
        scale_bytes = self._slot_bytes(t.scale)
        scale_bytes[:] = scales.scale_inv.reshape(-1).view(np.uint8)
        t.checksums[t.slot.name] = checksum(served)
        t.checksums[t.scale.name] = checksum(scale_bytes)
        t.nonfinite += stats.nonfinite
        t.saturated += stats.saturated
        idx = sampled_indices(0, master.size, self.stride)
        codes = served[idx]
        served_values = rounding.decode(codes, t.fmt) * rounding.element_scales(scales, idx)
        t.samples[0] = (master[idx], served_values.astype(np.float32), codes.astype(np.uint32))
        t.master = None
        self._stage_from_worker(-t.nbytes)
        self.export_seconds += time.perf_counter() - start

    def _stage_from_worker(self, nbytes: int) -> None:
        self.service.loop.call_soon_threadsafe(self._stage, nbytes)

    async def commit(self) -> tuple[Version, bool]:
        missing = [t for t in self.tensors.values() if t.received < t.nbytes]
        if missing:
            parts = [f"{t.spec.name!r} has {t.received} of {t.nbytes} bytes" for t in missing[:5]]
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise InvalidArgument(
                f"{self._where()}: commit of an incomplete push: {'; '.join(parts)}{more}",
                reason="incomplete",
            )
        await asyncio.gather(*self.pending)
        self.pending.clear()
        self.service.metrics.export_seconds.labels(self.spec.format, self.spec.rounding).observe(self.export_seconds)
        bad = [(t.spec.name, t.nonfinite) for t in self.tensors.values() if t.nonfinite]
        if bad and not self.service.settings.allow_nonfinite:
            listed = ", ".join(f"{n!r} ({c} NaN/Inf)" for n, c in bad[:10])
            more = f" and {len(bad) - 10} more tensors" if len(bad) > 10 else ""
            raise InvalidArgument(
                f"{self._where()}: master has non-finite values in {listed}{more}; "
                "rejected (serve with --allow-nonfinite to accept)",
                reason="nonfinite",
            )
        # Order-independent digest of the master: names, shapes and fp32 bytes.
        h = xxhash.xxh3_128()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(f"{name}\x00{list(t.spec.shape)}\x00{t.master_digest.hexdigest()}\n".encode())
        checksums = {n: c for t in self.tensors.values() for n, c in t.checksums.items()}
        slots = sorted([s for t in self.tensors.values() for s in (t.slot, t.scale) if s], key=lambda s: s.offset)
        manifest = Manifest(
            model=self.header.model,
            version=self.header.step,
            format=self.spec.format,
            rounding=self.spec.rounding,
            seed=self.spec.seed,
            committed_unix=time.time(),
            data_bytes=self.data_bytes,
            master_digest="xxh3_128:" + h.hexdigest(),
            tensors=tuple(dataclasses.replace(s, checksum=checksums[s.name]) for s in slots),
            scaling=self.spec.scaling if any(t.scale for t in self.tensors.values()) else "",
        )
        version = Version(manifest, manifest.safetensors_header(), self.data)
        residual = None
        if self.residual is not None:
            new = {name: t.new_residual for name, t in self.tensors.items() if t.new_residual is not None}
            residual = (
                self.base_version,
                rounding.Residual(self.header.step, new, self.spec.format, self.spec.scaling),
            )
        # By name, then element: the lag metrics depend neither on the order chunks arrived in nor
        # on the order the ranks declared the tensors in.
        sampled = [self.tensors[n].samples[first] for n in sorted(self.tensors)
                   for first in sorted(self.tensors[n].samples)]  # fmt: skip
        sample = Sample(*(np.concatenate([p[i] for p in sampled]) if sampled else np.zeros(0, dt)
                          for i, dt in enumerate((np.float32, np.float32, np.uint32))))  # fmt: skip
        saturated = sum(t.saturated for t in self.tensors.values())
        lag_input = (sample, saturated, self.stride == 1) if self.tensors else None  # (an empty part)
        committed, created = await self.service.store.commit(version, residual, lag_input, self.part_of)
        self.committed = created
        return committed, created

    async def close(self) -> None:
        """Release the staging memory; waits for exports already running so none writes after."""
        await asyncio.gather(*self.pending, return_exceptions=True)
        self.pending.clear()
        for t in self.tensors.values():
            t.master = t.new_residual = None
        self.service.metrics.staged_bytes.dec(self.staged_bytes)
        self.staged_bytes = 0
        if not self.committed:  # nobody else ever saw this buffer
            self.service.store.pool.give(self.data)
        self.data = memoryview(b"")


def scale_shape(shape: tuple[int, ...], scaling: str) -> tuple[int, ...]:
    n, k = shape
    if scaling == "tensor":
        return ()
    if scaling == "channel":
        return (n, 1)
    return (-(-n // rounding.BLOCK), -(-k // rounding.BLOCK))


def validate_header(header: PushHeader, settings: Settings) -> None:
    check_model_name(header.model)
    where = f"model {header.model!r} step {header.step}"
    if header.step < 0:
        raise InvalidArgument(f"{where}: step must be >= 0", reason="invalid_header")
    if not 1 <= header.world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(f"{where}: world_size {header.world_size} is not in [1, {MAX_WORLD_SIZE}]",
                              reason="invalid_header")  # fmt: skip
    if not 0 <= header.rank < header.world_size:
        raise InvalidArgument(f"{where}: rank {header.rank} is outside world_size {header.world_size}",
                              reason="invalid_header")  # fmt: skip
    if header.owners:
        if len(set(header.owners)) != len(header.owners) or not all(header.owners):
            raise InvalidArgument(f"{where}: owners {list(header.owners)} must be distinct replica ids",
                                  reason="invalid_header")  # fmt: skip
    elif not header.tensors:  # (a sharded replica may own none of a version's tensors)
        raise InvalidArgument(f"{where}: the push declares no tensors", reason="invalid_header")
    if len(header.tensors) > settings.max_tensors:
        raise ResourceExhausted(
            f"{where}: {len(header.tensors)} tensors, more than the {settings.max_tensors} a version may have "
            "(--max-tensors)",
            reason="too_large",
        )
    seen: set[str] = set()
    total = 0
    for t in header.tensors:
        if not t.name or len(t.name) > MAX_NAME_CHARS:
            raise InvalidArgument(
                f"{where}: tensor names must have 1-{MAX_NAME_CHARS} characters", reason="invalid_header"
            )
        if t.name in seen:
            raise InvalidArgument(f"{where}: tensor {t.name!r} is declared twice", reason="invalid_header")
        if t.name == RESERVED_NAME:
            raise InvalidArgument(
                f"{where}: {RESERVED_NAME!r} is reserved by the safetensors format", reason="invalid_header"
            )
        seen.add(t.name)
        if t.dtype not in DTYPE_SIZES:
            raise InvalidArgument(
                f"{where}: tensor {t.name!r} has unknown dtype {t.dtype!r} (known: {', '.join(DTYPE_SIZES)})",
                reason="invalid_header",
            )
        if t.dtype != MASTER_DTYPE:
            raise InvalidArgument(
                f"{where}: tensor {t.name!r} is {t.dtype}; masters are pushed as {MASTER_DTYPE}",
                reason="invalid_header",
            )
        if any(d < 0 for d in t.shape):
            raise InvalidArgument(
                f"{where}: tensor {t.name!r} has a negative dimension in shape {list(t.shape)}",
                reason="invalid_header",
            )
        if t.part is not None and (min(t.part) < 0 or sum(t.part) > t.numel):
            raise InvalidArgument(
                f"{where}: tensor {t.name!r}: part [{t.part[0]}, {sum(t.part)}) is not within its {t.numel} elements "
                f"(shape {list(t.shape)})",
                reason="invalid_header",
            )
        nbytes = t.numel * DTYPE_SIZES[t.dtype]
        if nbytes > settings.max_tensor_bytes:
            raise ResourceExhausted(
                f"{where}: tensor {t.name!r} of shape {list(t.shape)} holds {nbytes} bytes, more than the "
                f"{settings.max_tensor_bytes} bytes a tensor may have (--max-tensor-bytes)",
                reason="too_large",
            )
        total += nbytes
        if total > settings.max_version_bytes:
            raise ResourceExhausted(
                f"{where}: the masters declared up to tensor {t.name!r} already hold {total} bytes, more "
                f"than the {settings.max_version_bytes} bytes a version may have (--max-version-bytes)",
                reason="too_large",
            )


class Service:
    """The core shared by every transport: settings, store, metrics and the export workers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.metrics = Metrics()
        registry = (
            RedisRegistry(settings.redis_url, prefix=settings.redis_prefix) if settings.redis_url else MemoryRegistry()
        )
        self.store = VersionStore(
            retain=settings.retain, data_dir=settings.data_dir, metrics=self.metrics, registry=registry
        )
        # One export at a time: the kernel itself uses every core.
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="weightsvc-export", initializer=rounding.use_threads, initargs=(1,)
        )
        self._pushes: set[PushSession] = set()
        self._push_streams = 0  # push streams open (each rank's counts), against --max-pushes
        self._pulls = 0  # pulls holding a version, against --max-pulls
        self._groups: dict[tuple[str, int], RankGroup] = {}  # multi-rank pushes in progress
        self._releasing: set[asyncio.Future[None]] = set()
        self._changes = _Changes()
        self._staging_reserved = 0
        self._deltas: dict[tuple[str, int, int], bytes | None] = {}  # recent delta encodings, oldest first
        self._topology: list[Replica] | None = None  # the last the registry gave
        self._stopping = asyncio.Event()  # set when the server stops: watches end

    def restore(self) -> int:
        return self.store.restore()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    # ---- push --------------------------------------------------------------------------------

    async def push(self, messages: AsyncIterator[PushMessage]) -> tuple[Version, bool]:
        """Run one push stream: header, chunks, commit. Nothing is visible unless it commits.

        The stream of one rank of a multi-rank push returns when the whole version commits."""
        group: RankGroup | None = None
        rank = 0
        idle = self.settings.push_idle_timeout_s
        self.metrics.pushes_in_flight.inc()
        self._push_streams += 1
        try:
            if self._push_streams > self.settings.max_pushes:
                raise TooManyRequests(
                    f"{self._push_streams - 1} push streams in progress, the most this server takes "
                    f"(--max-pushes {self.settings.max_pushes}); retry later",
                    reason="too_many",
                )
            header = await self._next(messages, idle)
            if not isinstance(header, PushHeader):
                raise InvalidArgument("a push must start with its header", reason="invalid_header")
            if self.settings.relay_from:
                raise FailedPrecondition(
                    f"model {header.model!r} step {header.step}: this server relays {self.settings.relay_from}; "
                    "push there",
                    reason="relay",
                )
            validate_header(header, self.settings)
            if header.owners and self.store.replica_id not in header.owners:
                raise FailedPrecondition(
                    f"model {header.model!r} step {header.step}: this server is replica {self.store.replica_id!r}, "
                    f"not one of the owners {list(header.owners)}; push each part to its owner (GetTopology)",
                    reason="invalid_header",
                )
            self.store.check_step(header.model, header.step)
            rank = header.rank
            group = self._join(header)
            session = await group.wait_session()
            while True:
                msg = await self._next(messages, idle)
                if group.failure is not None:  # another rank failed: this one stops at its next message
                    raise group.failure
                if isinstance(msg, PushChunk):
                    await session.add_chunk(rank, msg)
                elif isinstance(msg, PushCommit):
                    session.check_rank_complete(rank)
                    version, created = await group.commit(rank, session.commit)
                    break
                elif msg is None:
                    raise Aborted(f"{session._where(rank)}: the stream ended without a commit", reason="aborted")
                else:
                    raise InvalidArgument(f"{session._where(rank)}: a second header", reason="invalid_header")
            if rank == 0:
                log.info(
                    "%s model=%s version=%d tensors=%d bytes=%d ranks=%d",
                    "committed" if created else "idempotent push of",
                    header.model,
                    header.step,
                    len(session.tensors),
                    session.data_bytes,
                    header.world_size,
                )
            return version, created
        except WeightsvcError as e:
            self.metrics.pushes_rejected.labels(e.reason).inc()
            if group is not None:
                group.fail(e, rank)
            raise
        except asyncio.CancelledError:
            self.metrics.pushes_rejected.labels("aborted").inc()
            if group is not None:
                group.fail(Aborted("the stream was cancelled", reason="aborted"), rank)
                staged = group.staged
                if staged is not None and staged.part_of is not None:  # its part, if waiting, is taken back
                    staged.part_of.abandoned.set()
            raise
        finally:
            self.metrics.pushes_in_flight.dec()
            self._push_streams -= 1
            if group is not None:
                group.attached -= 1
                staged = group.staged
                if group.attached == 0 and staged is not None:
                    # A cancelled handler may be cancelled again while it cleans up: release the
                    # staging memory in a task of its own so that it always completes.
                    release = asyncio.ensure_future(self._release(staged, group))
                    self._releasing.add(release)
                    release.add_done_callback(self._releasing.discard)
                    await asyncio.shield(release)
                elif group.attached == 0:
                    self._forget(group)

    def _join(self, header: PushHeader) -> RankGroup:
        """The group this rank's push belongs to; the last rank to join opens its session."""
        key = (header.model, header.step)
        group = self._groups.get(key) if header.world_size > 1 else None
        if group is None or group.failure is not None:
            group = RankGroup(header.model, header.step, header.world_size, self.settings.push_rank_timeout_s)
            if header.world_size > 1:
                self._groups[key] = group
        if group.join(header.rank, header.world_size, header.tensors, header.format, header.rounding):
            opening = asyncio.ensure_future(self._open_session(group, header))
            opening.add_done_callback(lambda f: f.cancelled() or f.exception())  # errors reach the ranks
        self._changes.notify()
        return group

    async def _open_session(self, group: RankGroup, header: PushHeader) -> None:
        try:
            tensors = merge_parts(group.where, group.headers)
            whole = dataclasses.replace(header, tensors=tensors, rank=0)
            validate_header(whole, self.settings)
            reserved = self._reserve_staging(whole)
            try:
                session = await PushSession.open(self, whole, group.headers)
            except BaseException:
                self._staging_reserved -= reserved
                raise
            session.reserved = reserved
        except WeightsvcError as e:
            group.fail(e)
            return
        if group.failure is not None:  # a rank failed while the buffers were being mapped
            await self._release(session, group)
            return
        self._pushes.add(session)
        self._changes.notify()
        group.session.set_result(session)

    def _forget(self, group: RankGroup) -> None:
        """A failed or committing group: a retry of its step forms a new one."""
        if self._groups.get((group.model, group.step)) is group:
            del self._groups[(group.model, group.step)]

    async def _release(self, session: PushSession, group: RankGroup) -> None:
        self._forget(group)
        if group.commit_task is not None:  # the version may be committing from this very buffer
            await asyncio.wait([group.commit_task])
        await session.close()
        self._staging_reserved -= session.reserved
        session.reserved = 0
        self._pushes.discard(session)
        self._changes.notify()

    def _reserve_staging(self, header: PushHeader) -> int:
        """Reserve the served bytes a push will stage, or refuse it if over the memory budget."""
        served = sum(t.numel for t in header.tensors) * 2  # every served format is at most 2 bytes
        rss, mark = resident_bytes(), self.settings.rss_high_water
        if rss + served > mark:
            raise ResourceExhausted(
                f"model {header.model!r} step {header.step}: this server holds {rss} bytes; staging {served} more "
                f"would pass its memory high-water mark of {mark} bytes (--max-rss-bytes); retry later",
                reason="too_large",
            )
        if self._staging_reserved + served > self.settings.max_staged_bytes:
            raise ResourceExhausted(
                f"model {header.model!r} step {header.step}: pushes in progress hold "
                f"{self._staging_reserved} bytes; {served} more would exceed the staging budget of "
                f"{self.settings.max_staged_bytes} bytes (--max-staged-bytes); retry later",
                reason="too_large",
            )
        self._staging_reserved += served
        return served

    @staticmethod
    async def _next(messages: AsyncIterator[PushMessage], idle: float) -> PushMessage | None:
        try:
            async with asyncio.timeout(idle):
                return await anext(messages)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise DeadlineExceeded(f"push stalled: nothing received for {idle:g} s", reason="aborted") from None

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; re-checked whenever a push or a pull starts or ends."""
        await self._changes.wait_for(predicate)

    async def wait_pushes(self, count: int) -> None:
        """Return once exactly `count` pushes are staged (0: every staging buffer released)."""
        await self.wait_for(lambda: len(self._pushes) == count)

    # ---- reads -------------------------------------------------------------------------------

    def models(self) -> list[ModelSummary]:
        out = []
        for model in self.store.models():
            versions = [v.manifest.version for v in self.store.versions(model)]
            out.append(ModelSummary(model, versions[-1], versions))
        return out

    def versions(self, model: str) -> list[Manifest]:
        return [v.manifest for v in self.store.versions(model)]

    def manifest(self, model: str, version: int | None) -> Manifest:
        return self.store.get(model, version).manifest

    def latest(self, model: str) -> int:
        """The model's latest committed version (NOT_FOUND for a model without any)."""
        return self.store.get(model, None).manifest.version

    async def pull(self, model: str, version: int | None, transport: str, *, base: int | None = None) -> Pull:
        """Start a pull of `version` (None: the latest). With `base` (a version the client holds), the
        body is the delta encoding against it when there is one, else the data section as always."""
        pull = Pull(self, self.open_pull(model, version, transport), transport)
        try:
            if base is not None and pull.version.part is None:
                with contextlib.suppress(FailedPrecondition):
                    pull.use_delta(base, await self.delta(pull.version, base))
        except BaseException:
            pull.close()
            raise
        return pull

    async def pull_delta(self, model: str, version: int | None, base: int, transport: str) -> Pull:
        """Start a pull whose body is the delta encoding of `version` against `base`; FAILED_PRECONDITION
        saying why when there is none (the client then pulls the whole version)."""
        pull = Pull(self, self.open_pull(model, version, transport), transport)
        try:
            pull.use_delta(base, await self.delta(pull.version, base))
        except BaseException:
            pull.close()
            raise
        return pull

    def open_pull(self, model: str, version: int | None, transport: str) -> Version:
        """Hold a version for a pull; eviction cannot recycle its buffer until `close_pull`."""
        if transport != "delta" and self._pulls >= self.settings.max_pulls:
            raise TooManyRequests(
                f"{self._pulls} pulls in progress, the most this server takes (--max-pulls "
                f"{self.settings.max_pulls}); retry later",
                reason="too_many",
            )
        held = self.store.get(model, version)
        self.store.hold(held)
        self._pulls += transport != "delta"
        self.metrics.pulls_in_flight.labels(transport).inc()
        return held

    def close_pull(self, version: Version, transport: str) -> None:
        self.metrics.pulls_in_flight.labels(transport).dec()
        self._pulls -= transport != "delta"
        self.store.release(version)
        self._changes.notify()

    async def delta(self, version: Version, base: int) -> bytes:
        """The delta encoding of `version` against `base` of the same model. FAILED_PRECONDITION, saying
        why, when there is none: the base is the version itself or not retained, either is sharded over
        replicas, their layouts differ, or the delta would not be smaller than the dense bytes."""
        m = version.manifest

        def none(why: str) -> FailedPrecondition:
            return FailedPrecondition(f"model {m.model!r} version {m.version}: no delta against base {base}: {why}; "
                                      "pull the whole version")  # fmt: skip

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
            held = self.open_pull(m.model, base, "delta")
        except NotFound as e:
            raise none(e.message) from None
        try:
            if held.part is not None:
                raise none("the base is sharded over replicas")
            if not delta_compatible(held.manifest, m):
                raise none("the base has other tensors, shapes or dtypes")
            encoded = await asyncio.to_thread(delta_encode, m, version.data, held.data)
        finally:
            self.close_pull(held, "delta")
        delta = encoded if len(encoded) < m.data_bytes else None
        self._deltas[key] = delta
        while len(self._deltas) > MAX_CACHED_DELTAS:
            self._deltas.pop(next(iter(self._deltas)))
        if delta is None:
            raise none(not_smaller)
        return delta

    async def mirror(self, manifest: Manifest, data: memoryview) -> None:
        """Commit a version pulled (and verified) from an upstream, as it is: a relay's commit. A
        version of sharded replicas is whole here: the relay serves all of it."""
        manifest = dataclasses.replace(manifest, parts=())
        await self.store.commit(Version(manifest, manifest.safetensors_header(), data))

    def count_pulled(self, model: str, transport: str, nbytes: int) -> None:
        self.metrics.pull_bytes.labels(model, transport).inc(nbytes)

    @overload
    def watch(self, model: str, after: int | None) -> AsyncIterator[Manifest]: ...

    @overload
    def watch(self, model: str, after: int | None, *, idle: float) -> AsyncIterator[Manifest | None]: ...

    def watch(self, model: str, after: int | None, *, idle: float | None = None) -> AsyncIterator[Manifest | None]:
        """Every retained version above `after` (all when None), then each new one as it commits. With
        `idle`, None after each `idle` seconds without one (for a transport's keepalive). Ends with
        UNAVAILABLE when the server stops (`end_watches`)."""
        check_model_name(model)  # here, not at the first event: a transport answers the error itself
        return watching(self.store.watch(model, after), self._stopping, idle)

    def end_watches(self) -> None:
        """The server is stopping: every watch stream ends now rather than hold up the shutdown."""
        self._stopping.set()

    def ack(self, model: str, version: int, client_id: str) -> int:
        return self.store.ack(model, version, client_id)

    async def topology(self) -> list[Replica]:
        """The replicas as the registry knows them; while it is unreachable, as it last knew them
        (clients keep pulling from the owners; pushes fail at their commit, with UNAVAILABLE)."""
        try:
            self._topology = await self.store.registry.replicas()
        except Unavailable:
            if self._topology is None:
                raise
        return self._topology

    def clients(self, model: str) -> list[ClientStatus]:
        """The clients that acked a version of `model`: what each holds, how far behind, whether it is
        still around (NOT_FOUND for an unknown model, as every model read)."""
        self.latest(model)
        horizon = time.time() - CLIENT_TIMEOUT_S
        return [
            ClientStatus(a.client_id, a.version, self.store.versions_behind(model, a.version), a.acked_unix,
                         a.acked_unix >= horizon)
            for a in self.store.clients(model)
        ]  # fmt: skip
