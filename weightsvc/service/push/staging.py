"""One version's staging: the served copy laid out as one data section, masters exported into it.

A push is staged privately: the served copy is laid out from the header(s), master bytes are exported
into their slots as they arrive (in a worker thread, overlapping the receipt of the next chunks), and
only `commit` makes the version visible. With a data dir the data section is staged in the version's
own file (a temporary one, mapped), so the served copy never sits in this process's memory and the
commit renames the file in place; without one it is a buffer in memory. The session computes; the
push that owns it (`core.push`) decides when it commits and when it is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from weightsvc import rounding
from weightsvc._aio import BIG_MANIFEST, in_thread
from weightsvc.errors import InvalidArgument
from weightsvc.memory import alloc
from weightsvc.protocol import topology
from weightsvc.protocol.digest import MasterDigest, checksum
from weightsvc.protocol.manifest import DTYPE_SIZES, MASTER_DTYPE, Manifest, Part, ServedTensor, TensorSpec, layout
from weightsvc.protocol.topology import Group
from weightsvc.service.device import Resident
from weightsvc.service.versions.index import VersionFile
from weightsvc.service.versions.lag import Sample, sample_stride, sampled_indices
from weightsvc.service.versions.store import PartOf, Version

if TYPE_CHECKING:
    from weightsvc.service.push.pushes import PushChunk, PushHeader
    from weightsvc.service.service import Service

# Chunks received but not yet exported, per push: bounds staging memory, and pushes back on the
# learner (gRPC flow control) when export is slower than the network.
MAX_PENDING_CHUNKS = 8
MASTER_ITEMSIZE = DTYPE_SIZES[MASTER_DTYPE]
# Small chunks are handed to the export thread together, up to this many bytes or chunks.
BATCH_BYTES = 1 << 20
BATCH_JOBS = 512
# Room in a staged file's header beyond the manifest known at the start (its lag metrics and, on a
# sharded replica, its part come at commit). A header that still does not fit is written with a copy.
HEADER_SLACK = 4096



class _StagedTensor:
    def __init__(self, spec: TensorSpec, fmt: rounding.Format, slots: Sequence[ServedTensor]):
        self.spec = spec
        self.fmt = fmt
        self.slot = slots[0]  # the served elements
        self.scales = tuple(slots[1:])  # a scaled format's scale tensors (`rounding.served_tensors`)
        # NVFP4: the tensors an engine fuses with this one (itself included), which share its global
        # scale: exported together, once all of them are here.
        self.fused: _Fused | None = None
        self.nbytes = spec.numel * DTYPE_SIZES[spec.dtype]
        self.received = 0  # bytes accepted on the loop, from all ranks
        # Filled by the export worker, chunk by chunk, in arrival order:
        self.exported = 0  # bytes exported (bf16/fp16) or gathered (scaled formats)
        self.master: np.ndarray | None = None  # scaled formats: scales need the whole tensor first
        self.new_residual: np.ndarray | None = None  # ef: this version's residual
        self.master_digest = MasterDigest(self.nbytes)
        self.nonfinite = 0
        self.saturated = 0
        self.checksums: dict[str, str] = {}
        # first element of a chunk -> its sampled (master, served, bits)
        self.samples: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


class _Fused:
    """The tensors of a push that share NVFP4's global scale (`rounding.fused_group`)."""

    def __init__(self) -> None:
        self.members: list[_StagedTensor] = []
        self.started = False

    def ready(self) -> bool:
        return not self.started and all(t.received == t.nbytes for t in self.members)


class _Part:
    """The bytes [start, end) of a tensor that one rank pushes, in order."""

    def __init__(self, tensor: _StagedTensor, start: int, end: int) -> None:
        self.tensor = tensor
        self.start = start
        self.end = end
        self.received = start



class PushSession:
    """The staging of one version, shared by the ranks that push it. Owns its staging memory until
    `close`; it computes, and the `Push` that opened it decides its fate.

    bf16/fp16 export is elementwise with the flat element index as a key, so each chunk is
    exported into its slot of the data section as it arrives and the master is never assembled.
    fp8 tensors need their scales first: their chunks are gathered and exported once complete.
    With `ef`, the residual of the latest committed version is read and a new one written; it
    replaces the model's residual only if this version commits.
    """

    def __init__(self, service: Service, header: PushHeader, spec: rounding.ExportSpec, data: memoryview,
                 plan: _Plan, file: VersionFile | None,
                 staged_residual: tuple[VersionFile, dict[str, np.ndarray]] | None = None) -> None:
        self.service = service
        self.header = header
        self.spec = spec
        self.data = data
        self.file = file  # with a data dir: the staged file that `data` maps
        # With a data dir and ef: the file the new residual is staged in, and its arrays.
        self.residual_file: VersionFile | None = None
        tensors = plan.tensors
        if staged_residual is not None:
            self.residual_file, arrays = staged_residual
            for name, array in arrays.items():
                tensors[name].new_residual = array
        self.data_bytes = plan.data_bytes
        self.tensors = tensors
        self.parts = plan.parts
        self.segments = plan.segments
        self.kernels = service.export_kernels()
        # ef on a GPU: the new residual's chunks there, kept for the next push if this one commits.
        self.device_residuals: Resident = {}
        self.residual = (
            service.store.residual(header.model, spec.format, spec.scaling, plan.groups if header.owners else None)
            if spec.rounding == "ef" else None
        )
        self.base_version = service.store.latest(header.model)  # an ef push continues from this one
        # Sharded replicas: this push is this replica's part of the version.
        timeout = service.settings.push_rank_timeout_s
        self.part_of = PartOf(header.owners, timeout) if header.owners else None
        self.stride = sample_stride(plan.numel)
        self.staged_bytes = 0
        self._stage(plan.data_bytes)
        self.pending: collections.deque[asyncio.Future[None]] = collections.deque()
        self.batch: list[tuple[Callable[[_StagedTensor, int, bytes | memoryview], None], _StagedTensor, int,
                               bytes | memoryview]] = []
        self.batch_bytes = 0
        self.committed = False
        self.reserved = 0  # of the service's staging budget, returned when the session closes
        self.export_seconds = 0.0
        for t in plan.empty:  # no chunk comes for them
            if t.fmt.scaled:
                self._whole(t)
            else:
                self._start(self._export_chunk, t, 0, b"")

    @classmethod
    async def open(cls, service: Service, header: PushHeader, ranks: dict[int, tuple[TensorSpec, ...]]) -> PushSession:
        """Stage the version that `header` declares (whole tensors); `ranks` holds each rank's parts."""
        s = service.settings
        where = f"model {header.model!r} step {header.step}"
        if header.owners:  # decide from the latest version the registry holds, as the other owners do
            await service.store.committer.follower.catch_up(header.model)
        try:
            spec = rounding.ExportSpec(header.format or s.format, header.rounding or s.rounding, s.seed, s.scaling,
                                       s.fp8_pattern)
        except ValueError as e:
            raise InvalidArgument(f"{where}: {e}", reason="invalid_header") from None
        big = len(header.tensors) >= BIG_MANIFEST
        plan = await in_thread(big, _plan, header, spec, ranks, where, service.store.replica_id)
        files, file, staged_residual = service.store.files, None, None
        if files is not None:
            # The header is known only at commit (checksums, lag): leave room for it before the data.
            room = await in_thread(big, _header_room, header, spec, plan)
            # On a full disk the model's oldest versions make room (`Committer.on_disk`).
            model, step, on_disk = header.model, header.step, service.store.on_disk
            file = await on_disk(model, step, functools.partial(files.stage, model, step, room, plan.data_bytes))
            if spec.rounding == "ef":  # the new residual is staged in a file of its own
                numels = {name: t.spec.numel for name, t in plan.tensors.items()}
                try:
                    stage = functools.partial(files.stage_residual, model, step, numels, spec.format, spec.scaling)
                    staged_residual = await on_disk(model, step, stage)
                except BaseException:
                    await asyncio.to_thread(files.discard, file)
                    raise
            data = file.data  # (taken before, this view would keep a discarded file's blocks mapped)
        else:
            recycled = service.store.pool.take(plan.data_bytes)
            # Mapping fresh pages takes a while: off the loop.
            data = recycled if recycled is not None else await asyncio.to_thread(alloc, plan.data_bytes)
        return cls(service, header, spec, data, plan, file, staged_residual)

    def where(self, rank: int | None = None) -> str:
        where = f"model {self.header.model!r} step {self.header.step}"
        return where if rank is None or len(self.parts) == 1 else f"{where} rank {rank}"

    def check_rank_complete(self, rank: int) -> None:
        missing = [p for p in self.parts[rank].values() if p.received < p.end]
        if missing:
            shown = [f"{p.tensor.spec.name!r} has {p.received - p.start} of {p.end - p.start} bytes"
                     for p in missing[:5]]
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise InvalidArgument(
                f"{self.where(rank)}: commit of an incomplete push: {'; '.join(shown)}{more}", reason="incomplete"
            )

    async def add_chunks(self, rank: int, chunks: Sequence[PushChunk]) -> None:
        """Accept a rank's chunks (one wire message: many small tensors travel packed in one), hand
        them to the export thread, and wait while it is too far behind."""
        n = 0
        for chunk in chunks:
            n += self._accept(rank, chunk)
        self.service.metrics.push_bytes.labels(self.header.model).inc(n)
        while self.pending and self.pending[0].done():
            self.pending.popleft().result()
        if len(self.pending) > MAX_PENDING_CHUNKS:
            # Shielded: the ranks of a push share these futures, and a rank whose stream is cancelled
            # must not cancel the export another rank waits on.
            await asyncio.shield(self.pending[0])

    def _accept(self, rank: int, chunk: PushChunk) -> int:
        """Check one chunk against its rank's part and queue its export; its size."""
        where = self.where(rank)
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
            )
        if n % MASTER_ITEMSIZE:
            raise InvalidArgument(
                f"{where}: tensor {t.spec.name!r}: a chunk of {n} bytes splits an element "
                f"(chunks carry whole {MASTER_DTYPE} elements of {MASTER_ITEMSIZE} bytes)",
                reason="bad_chunk",
            )
        first = t.received == 0
        part.received += n
        t.received += n
        if first and self.residual is not None and self.residual_file is None:
            self._stage(t.nbytes)  # the new residual of this tensor, in memory
        if t.fmt.scaled:
            if first:
                self._stage(t.nbytes)  # the gathered master
            self._start(self._gather_chunk, t, chunk.offset, chunk.data)
            if t.received == t.nbytes:
                self._whole(t)
        else:
            self._start(self._export_chunk, t, chunk.offset, chunk.data)
        return n

    def _whole(self, t: _StagedTensor) -> None:
        """A scaled tensor is all here: export it, or, when it shares a global scale with others, the
        group once they all are."""
        if t.fused is None:
            self._start(self._export_whole, t, 0, b"")
        elif t.fused.ready():
            t.fused.started = True
            self._start(self._export_fused, t, 0, b"")

    def _start(self, job: Callable[[_StagedTensor, int, bytes | memoryview], None], t: _StagedTensor,
               byte_offset: int, data: bytes | memoryview) -> None:
        """Queue work for the export thread: one thread, so a tensor's chunks are handled in order.
        Small chunks (many small tensors) go in batches: one hand-over to the thread costs more than
        exporting a small tensor. Staged bytes count at the hand-over (one metric update a batch)."""
        self.batch.append((job, t, byte_offset, data))
        self.batch_bytes += len(data)
        if self.batch_bytes >= BATCH_BYTES or len(self.batch) >= BATCH_JOBS:
            self._flush()

    def _flush(self) -> None:
        """Hand the batched chunks to the export thread."""
        if not self.batch:
            return
        jobs, n = self.batch, self.batch_bytes
        self.batch, self.batch_bytes = [], 0
        self._stage(n)
        fut = asyncio.get_running_loop().run_in_executor(self.service.executor, self._run_all, jobs)
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

    def _run_all(self, jobs: list[tuple[Callable[..., None], _StagedTensor, int, bytes | memoryview]]) -> None:
        """Worker thread: a batch of jobs, in order. Its small bf16 chunks (rtn or sr) are exported
        first, in one kernel call: one call each would cost more than their export."""
        small: list[int] = []
        if self.spec.format == "bf16" and self.spec.rounding != "ef":  # (every tensor bf16, no residual)
            small = [i for i, (job, _, _, data) in enumerate(jobs)
                     if job == self._export_chunk and len(data) < BATCH_BYTES]
        fused = set(small) if len(small) > 1 else set()
        if fused:
            self._export_runs([jobs[i][1:] for i in small])
        for i, (job, t, offset, data) in enumerate(jobs):
            if i not in fused:
                job(t, offset, data)

    def _export_runs(self, runs: list[tuple[_StagedTensor, int, bytes | memoryview]]) -> None:
        """Worker thread: `_export_chunk` of many small bf16 chunks at once, each kernel call and
        array operation made once for all of them."""
        start = time.perf_counter()
        sizes = np.fromiter((len(data) for _, _, data in runs), np.int64, len(runs)) // MASTER_ITEMSIZE
        starts = np.zeros(len(runs) + 1, np.int64)
        np.cumsum(sizes, out=starts[1:])
        master = np.frombuffer(b"".join(data for _, _, data in runs), np.float32)
        firsts = np.fromiter((offset for _, offset, _ in runs), np.int64, len(runs)) // MASTER_ITEMSIZE
        outs = np.fromiter((t.slot.offset for t, _, _ in runs), np.int64, len(runs)) // 2 + firsts
        served = np.frombuffer(self.data, np.uint16, count=len(self.data) // 2)
        names = [t.spec.name for t, _, _ in runs]
        stats = self.kernels.export_runs(master, starts, served, self.spec, version=self.header.step, names=names,
                                     offsets=firsts.tolist(), outs=outs)
        # The sampled elements of every run: those whose flat index in their tensor is a multiple of
        # the stride (as `_export_chunk` takes them), gathered with one index array.
        skip = -firsts % self.stride
        taken = np.maximum(0, (sizes - skip + self.stride - 1) // self.stride)
        run_of = np.repeat(np.arange(len(runs)), taken)
        within = skip[run_of] + self.stride * (np.arange(run_of.size) - np.repeat(np.cumsum(taken) - taken, taken))
        codes = served[outs[run_of] + within]
        sample = (master[starts[run_of] + within], rounding.decode(codes, rounding.FORMATS["bf16"]),
                  codes.astype(np.uint32))
        bounds = np.cumsum(taken).tolist()
        for j, (t, offset, data) in enumerate(runs):
            t.master_digest.update(offset, data)
            t.nonfinite += stats[j].nonfinite
            t.saturated += stats[j].saturated
            if taken[j]:
                a, b = bounds[j] - int(taken[j]), bounds[j]
                t.samples[int(firsts[j])] = (sample[0][a:b], sample[1][a:b], sample[2][a:b])
            t.exported += len(data)
            if t.exported == t.nbytes:
                t.checksums[t.slot.name] = checksum(self.data[t.slot.offset : t.slot.offset + t.slot.nbytes])
        self.export_seconds += time.perf_counter() - start

    def _export_chunk(self, t: _StagedTensor, byte_offset: int, data: bytes | memoryview) -> None:
        """Worker thread: Fair Cast one chunk into the tensor's slot (bf16/fp16)."""
        start = time.perf_counter()
        master = np.frombuffer(data, dtype=np.float32)
        served = self._slot_bytes(t.slot)
        first, count, size = byte_offset // MASTER_ITEMSIZE, master.size, t.fmt.itemsize
        res_in, res_out = self._residuals(t)
        stats = self.kernels.export_array(
            master, served[first * size : (first + count) * size], self.spec, version=self.header.step,
            name=t.spec.name, fmt=t.fmt, offset=first,
            residual=None if res_in is None else res_in[first : first + count],
            new_residual=None if res_out is None else res_out[first : first + count],
            model=self.header.model, keep=self.device_residuals,
        )
        t.master_digest.update(byte_offset, data)
        t.nonfinite += stats.nonfinite
        t.saturated += stats.saturated
        skip = -first % self.stride  # the sampled elements of this chunk, as strided views
        if skip < count:
            codes = served[first * size : (first + count) * size].view(np.uint16 if size == 2 else np.uint8)
            codes = codes[skip :: self.stride]
            t.samples[first] = (master[skip :: self.stride].copy(), rounding.decode(codes, t.fmt),
                                codes.astype(np.uint32))
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

    def _export_fused(self, t: _StagedTensor, _offset: int, _data: bytes | memoryview) -> None:
        """Worker thread: the tensors that share t's global scale, from the max |value| over all of
        them (of m + e with ef, as the export quantizes)."""
        assert t.fused is not None
        values = []
        for member in t.fused.members:
            res_in, _ = self._residuals(member)
            master = member.master if member.master is not None else np.empty(0, np.float32)
            values.append(master if res_in is None else master + res_in)
        top = rounding.group_amax(values)
        for member in t.fused.members:
            self._export_whole(member, 0, b"", top)

    def _export_whole(self, t: _StagedTensor, _offset: int, _data: bytes | memoryview,
                      group_amax: float | None = None) -> None:
        """Worker thread: scales from the whole tensor, then Fair Cast it and serve the scales."""
        start = time.perf_counter()
        master = t.master if t.master is not None else np.empty(0, np.float32)
        res_in, res_out = self._residuals(t)
        served = self._slot_bytes(t.slot)
        stats, scales = self.kernels.export_whole(
            master, served, self.spec, version=self.header.step, name=t.spec.name, fmt=t.fmt, shape=t.spec.shape,
            residual=res_in, new_residual=res_out, model=self.header.model, keep=self.device_residuals,
            group_amax=group_amax,
        )
        t.checksums[t.slot.name] = checksum(served)
        for slot, array in zip(t.scales, rounding.served_scales(scales, t.fmt), strict=True):
            scale_bytes = self._slot_bytes(slot)
            scale_bytes[:] = array.view(np.uint8)
            t.checksums[slot.name] = checksum(scale_bytes)
        t.nonfinite += stats.nonfinite
        t.saturated += stats.saturated
        idx = sampled_indices(0, master.size, self.stride)
        # An element's code: its byte, or its nibble of a packed byte (element 2i in the low one).
        codes = (served[idx >> 1] >> ((idx & 1) << 2).astype(np.uint8)) & 0xF if t.fmt.packed else served[idx]
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
                f"{self.where()}: commit of an incomplete push: {'; '.join(parts)}{more}",
                reason="incomplete",
            )
        self._flush()
        await asyncio.gather(*self.pending)
        self.pending.clear()
        self.service.metrics.export_seconds.labels(self.spec.format, self.spec.rounding).observe(self.export_seconds)
        bad = [(t.spec.name, t.nonfinite) for t in self.tensors.values() if t.nonfinite]
        if bad and not self.service.settings.allow_nonfinite:
            listed = ", ".join(f"{n!r} ({c} NaN/Inf)" for n, c in bad[:10])
            more = f" and {len(bad) - 10} more tensors" if len(bad) > 10 else ""
            raise InvalidArgument(
                f"{self.where()}: master has non-finite values in {listed}{more}; "
                "rejected (serve with --allow-nonfinite to accept)",
                reason="nonfinite",
            )
        version, residual, lag_input = await in_thread(len(self.tensors) >= BIG_MANIFEST, self._prepared)
        committed, created = await self.service.store.commit(version, residual, lag_input, self.part_of)
        self.committed = created
        if created and self.device_residuals:
            self.kernels.keep_resident(self.header.model, self.device_residuals)
        return committed, created

    def _prepared(self) -> tuple[Version, tuple[int | None, rounding.Residual, VersionFile | None] | None,
                                 tuple[Sample, int, bool] | None]:
        """The version to commit (its manifest), the new ef residual and the lag metrics' input, from
        the exported tensors (linear in the tensors: off the loop for a big push)."""
        # Order-independent digest of the master: names, shapes and fp32 bytes.
        h = xxhash.xxh3_128()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(f"{name}\x00{list(t.spec.shape)}\x00{t.master_digest.hexdigest()}\n".encode())
        for alias, target in self.header.aliases:
            h.update(f"{alias}\x00={target}\n".encode())
        checksums = {n: c for t in self.tensors.values() for n, c in t.checksums.items()}
        slots = [s for t in self.tensors.values() for s in (t.slot, *t.scales)]
        scaled = any(t.scales for t in self.tensors.values())
        manifest = _manifest(self.header, self.spec, slots, self.data_bytes, scaled, checksums,
                             "xxh3_128:" + h.hexdigest(), self.segments)
        version = Version(manifest, b"", self.data, file=self.file)  # its header is made at commit, with the lag
        residual = None
        if self.residual is not None:
            new = {name: t.new_residual for name, t in self.tensors.items() if t.new_residual is not None}
            residual = (
                self.base_version,
                rounding.Residual(self.header.step, new, self.spec.format, self.spec.scaling),
                self.residual_file,
            )
        # By name, then element: the lag metrics depend neither on the order chunks arrived in nor
        # on the order the ranks declared the tensors in.
        sampled = [self.tensors[n].samples[first] for n in sorted(self.tensors)
                   for first in sorted(self.tensors[n].samples)]
        sample = Sample(*(np.concatenate([p[i] for p in sampled]) if sampled else np.zeros(0, dt)
                          for i, dt in enumerate((np.float32, np.float32, np.uint32))))
        saturated = sum(t.saturated for t in self.tensors.values())
        lag_input = (sample, saturated, self.stride == 1) if self.tensors else None  # (an empty part)
        return version, residual, lag_input

    async def close(self) -> None:
        """Release the staging memory; waits for exports already running so none writes after."""
        self.batch.clear()
        await asyncio.gather(*self.pending, return_exceptions=True)
        self.pending.clear()
        for t in self.tensors.values():
            t.master = t.new_residual = None
        self.service.metrics.staged_bytes.dec(self.staged_bytes)
        self.staged_bytes = 0
        files = self.service.store.files
        if self.residual_file is not None and files is not None:
            await asyncio.to_thread(files.discard, self.residual_file)  # (committed, it was renamed)
            self.residual_file = None
        if self.file is not None and files is not None:
            # Committed, the version maps its file under its own name; else the temporary file goes.
            with contextlib.suppress(BufferError):
                self.data.release()
            await asyncio.to_thread(files.discard, self.file)
            self.file = None
        elif not self.committed:  # nobody else ever saw this buffer
            self.service.store.pool.give(self.data)
        self.data = memoryview(b"")


def _manifest(header: PushHeader, spec: rounding.ExportSpec, slots: Iterable[ServedTensor], data_bytes: int,
              scaled: bool, checksums: Mapping[str, str], master_digest: str,
              segments: tuple[Part, ...] = ()) -> Manifest:
    """The manifest of the version a push stages, less its lag metrics (the commit adds them)."""
    ordered = sorted(slots, key=lambda s: s.offset)
    return Manifest(
        model=header.model,
        version=header.step,
        format=spec.format,
        rounding=spec.rounding,
        seed=spec.seed,
        committed_unix=time.time(),
        data_bytes=data_bytes,
        master_digest=master_digest,
        tensors=tuple(ServedTensor(s.name, s.shape, s.dtype, s.offset, s.nbytes, checksums[s.name]) for s in ordered),
        scaling=spec.scaling if scaled else "",
        parts=segments,
        aliases=header.aliases,
        owners=tuple(sorted(header.owners)),
    )


@dataclasses.dataclass
class _Plan:
    """Where each tensor of a push is served: its format, its slot in the data section, and the part
    each rank pushes of it."""

    tensors: dict[str, _StagedTensor]
    parts: dict[int, dict[str, _Part]]
    data_bytes: int
    slots: list[ServedTensor]
    numel: int  # elements of all the masters
    empty: list[_StagedTensor]  # the tensors without elements
    # Replicated sharded replicas: the groups of tensors this replica holds, one after the other in
    # the data section, each laid out as every other owner of the group lays it out.
    segments: tuple[Part, ...] = ()
    groups: dict[str, Group] = dataclasses.field(default_factory=dict)  # each tensor's owners


def _plan(header: PushHeader, spec: rounding.ExportSpec, ranks: dict[int, tuple[TensorSpec, ...]],
          where: str, replica: str = "") -> _Plan:
    """The plan of a push (pure, linear in its tensors: run off the loop for a big header)."""
    declared = {t.name for t in header.tensors}
    aliases_of: dict[str, tuple[str, ...]] = {}
    for alias, target in header.aliases:
        if target not in declared:
            raise InvalidArgument(f"{where}: alias {alias!r} names tensor {target!r}, which the push does "
                                  "not declare", reason="invalid_header")
        aliases_of[target] = (*aliases_of.get(target, ()), alias)
    entries, fmts = [], {}
    base_of: dict[str, str] = {}  # each served tensor's master
    place: dict[str, int] = {}  # its place among its master's served tensors (elements, then scales)
    for t in header.tensors:
        fmt = fmts[t.name] = spec.format_for(t.name, t.shape, aliases_of.get(t.name, ()))
        for i, served in enumerate(rounding.served_tensors(t.name, t.shape, fmt, spec.scaling)):
            entries.append(served)
            base_of[served[0]], place[served[0]] = t.name, i
    if len(base_of) < len(entries):
        names = collections.Counter(name for name, _, _ in entries)
        clash = next(name for name, count in names.items() if count > 1)
        raise InvalidArgument(f"{where}: tensor {clash!r} clashes with a served tensor of another (its scales "
                              "or packed elements)", reason="invalid_header")
    segments: tuple[Part, ...] = ()
    of = topology.groups([t.name for t in header.tensors], header.owners, header.replication) if header.owners else {}
    if header.owners and header.replication > 1:
        slots_list, data_bytes, segments = _grouped(entries, base_of, of, replica, where)
    else:
        slots_list, data_bytes = layout(entries)
    slots: dict[str, list[ServedTensor]] = {}
    for slot in slots_list:
        slots.setdefault(base_of[slot.name], []).append(slot)
    tensors = {t.name: _StagedTensor(t, fmts[t.name], sorted(slots[t.name], key=lambda slot: place[slot.name]))
               for t in header.tensors}
    fused: dict[str, _Fused] = {}
    for staged in tensors.values():
        if staged.fmt.global_scale:
            staged.fused = fused.setdefault(rounding.fused_group(staged.spec.name), _Fused())
            staged.fused.members.append(staged)
    parts = {
        rank: {p.name: _Part(tensors[p.name], p.elements[0] * MASTER_ITEMSIZE, sum(p.elements) * MASTER_ITEMSIZE)
               for p in specs}
        for rank, specs in ranks.items()
    }
    return _Plan(tensors, parts, data_bytes, slots_list, sum(t.spec.numel for t in tensors.values()),
                 [t for t in tensors.values() if t.nbytes == 0], segments, of)


def _grouped(entries: list[tuple[str, tuple[int, ...], str]], base_of: Mapping[str, str], of: dict[str, Group],
             replica: str, where: str) -> tuple[list[ServedTensor], int, tuple[Part, ...]]:
    """The layout of a replicated part (`of`: each tensor's owners): its tensors by group (sorted by
    owners), each group's by name, so that every owner of a group places its bytes the same way."""
    by_group: dict[Group, list[tuple[str, tuple[int, ...], str]]] = {}
    for entry in entries:
        base = base_of[entry[0]]  # (the master tensor of a scale or of packed elements)
        group = of[base]
        if replica and replica not in group:
            raise InvalidArgument(f"{where}: tensor {base!r} belongs to replicas {list(group)}, not to this one "
                                  f"({replica!r}); push each tensor to its owners (GetTopology)",
                                  reason="invalid_header")
        by_group.setdefault(group, []).append(entry)
    slots: list[ServedTensor] = []
    segments: list[Part] = []
    offset = 0
    for group in sorted(by_group):
        placed, end = layout(sorted(by_group[group]), offset)
        slots += placed
        segments.append(Part(replica, offset, end - offset, group, len(placed)))
        offset = end
    return slots, offset, tuple(segments)


def _header_room(header: PushHeader, spec: rounding.ExportSpec, plan: _Plan) -> int:
    """Bytes to leave for the file header in front of a staged version's data: that of the manifest
    as far as it is known (every checksum as long as a real one), and room for what the commit adds."""
    blank = checksum(b"")
    scaled = any(t.scales for t in plan.tensors.values())
    sized = _manifest(header, spec, plan.slots, plan.data_bytes, scaled, {s.name: blank for s in plan.slots},
                      "xxh3_128:" + "0" * 32, plan.segments)
    return len(sized.safetensors_header()) + HEADER_SLACK
