"""One version's staging: the served copy laid out as one data section, masters exported into it.

A push is staged privately: the served copy is laid out from the ranks' headers (plan.py), master
bytes are checked against each rank's shard as they arrive and handed to the export thread
(export.py), overlapping the receipt of the next chunks, and only `commit` makes the version
visible. With a data dir the data section is staged in the version's own file (a temporary one,
mapped), so the served copy never sits in this process's memory and the commit renames the file in
place; without one it is a buffer in memory. The session computes; the `Push` that owns it
(pushes.py) decides when it commits and when it is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Sequence

import numpy as np
from prometheus_client import Gauge

from weightsvc import rounding
from weightsvc._aio import BIG_MANIFEST, in_thread, let_go
from weightsvc.errors import Aborted, InvalidArgument, subject
from weightsvc.protocol.lag import Sample, sample_stride
from weightsvc.protocol.manifest import MASTER_DTYPE, TensorSpec
from weightsvc.service.push.context import PushContext
from weightsvc.service.push.export import BATCH_BYTES, ExportJobs, Job, JobFn
from weightsvc.service.push.messages import Committed, PushChunk, PushHeader
from weightsvc.service.push.plan import (
    MASTER_ITEMSIZE,
    Plan,
    PushedTensor,
    RankShard,
    exported_manifest,
    header_room,
    make_plan,
)
from weightsvc.service.record import Version, VersionFile
from weightsvc.service.replicas.parts import PartOf

# Chunks received but not yet exported, per push: bounds staging memory, and pushes back on the
# learner (gRPC flow control) when export is slower than the network.
MAX_PENDING_CHUNKS = 8
# Small chunks are handed to the export thread together, up to this many bytes or chunks.
BATCH_JOBS = 512
# The chunks of one message accepted between two turns of the event loop (a few milliseconds' work).
ACCEPT_SLICE = 256
NewResidual = tuple[VersionFile, dict[str, np.ndarray]]  # with a data dir: its file, and its arrays


class _Held:
    """The staging memory a session holds, counted in the staged-bytes metric. Its own object, so that
    the export jobs report to it without holding the session (a cycle would keep the session's
    mappings until the garbage collector runs, and a full disk needs their blocks back at once)."""

    def __init__(self, gauge: Gauge, loop: asyncio.AbstractEventLoop) -> None:
        self.nbytes = 0
        self._gauge = gauge
        self._loop = loop

    def add(self, nbytes: int) -> None:
        self.nbytes += nbytes
        self._gauge.inc(nbytes)

    def freed_by_worker(self, nbytes: int) -> None:
        self._loop.call_soon_threadsafe(self.add, -nbytes)


class PushSession:
    """The staging of one version, shared by the ranks that push it. Owns its staging memory until
    `close`; it computes, and the `Push` that opened it decides its fate. With `ef`, the new
    residual replaces the model's only if this version commits."""

    def __init__(self, context: PushContext, header: PushHeader, spec: rounding.ExportSpec, data: memoryview,
                 plan: Plan, file: VersionFile | None, new_residual: NewResidual | None = None) -> None:
        self.context = context
        self.header = header
        self.spec = spec
        self.data = data
        self.file = file  # with a data dir: the staged file that `data` maps
        self.residual_file: VersionFile | None = None  # with a data dir and ef: where the new residual goes
        if new_residual is not None:
            self.residual_file, arrays = new_residual
            for name, array in arrays.items():
                plan.tensors[name].new_residual = array
        self.plan = plan
        self.tensors = plan.tensors
        self.shards = plan.shards
        groups = plan.groups if header.owners else None
        residual = (context.committer.residuals.for_push(header.model, spec.format, spec.scaling, groups)
                    if spec.rounding == "ef" else None)
        self.base_version = context.index.latest(header.model)  # an ef push continues from this one
        # Sharded replicas: this push is this replica's part of the version.
        self.part_of = PartOf(header.owners, context.settings.push_rank_timeout_s) if header.owners else None
        self.held = _Held(context.metrics.staged_bytes, context.loop)
        self.held.add(plan.data_bytes)
        self.jobs = ExportJobs(data, spec, context.exporter(), model=header.model, step=header.step,
                               stride=sample_stride(plan.numel), residual=residual, freed=self.held.freed_by_worker,
                               batch_small=context.batch_small)
        self.pending: collections.deque[asyncio.Future[None]] = collections.deque()
        self.batch: list[Job] = []
        self.batch_bytes = 0
        self.committed = False
        self.closed = False
        self.reserved = 0  # of the staging budget, returned when the session closes
        for t in plan.empty:  # no chunk comes for them
            if t.fmt.scaled:
                self._whole(t)
            else:
                self._start(self.jobs.export_chunk, t, 0, b"")

    def where(self, rank: int | None = None) -> str:
        where = subject(self.header.model, step=self.header.step)
        return where if rank is None or len(self.shards) == 1 else f"{where} rank {rank}"

    def rank_bytes(self, rank: int) -> int:
        """The bytes of the rank's shards."""
        return sum(shard.end - shard.start for shard in self.shards[rank].values())

    def check_rank_complete(self, rank: int) -> None:
        missing = [shard for shard in self.shards[rank].values() if shard.received < shard.end]
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
        if self.context.on_chunks is not None:
            self.context.on_chunks(rank, chunks)
        n = 0
        for i, chunk in enumerate(chunks):
            if i and not i % ACCEPT_SLICE:  # a message of many small tensors: give way to the other requests
                await asyncio.sleep(0)
                if self.closed:
                    raise Aborted(f"{self.where(rank)}: the push ended while its chunks were accepted",
                                  reason="aborted")
            n += self._accept(rank, chunk)
        self.context.metrics.push_bytes.labels(self.header.model).inc(n)
        while self.pending and self.pending[0].done():
            self.pending.popleft().result()
        if len(self.pending) > MAX_PENDING_CHUNKS:
            # Shielded: the ranks of a push share these futures, and a rank whose stream is cancelled
            # must not cancel the export another rank waits on.
            await asyncio.shield(self.pending[0])

    def _accept(self, rank: int, chunk: PushChunk) -> int:
        """Check one chunk against its rank's shard and queue its export; its size."""
        shard = self.shards[rank].get(chunk.tensor)
        if shard is None:
            raise InvalidArgument(f"{self.where(rank)}: chunk for undeclared tensor {chunk.tensor!r}",
                                  reason="bad_chunk")
        t = shard.tensor
        if chunk.offset != shard.received:
            raise InvalidArgument(
                f"{self.where(rank)}: tensor {t.spec.name!r}: chunk at byte offset {chunk.offset}, expected "
                f"{shard.received} (the chunks of a tensor or part arrive in order, without gaps or overlaps)",
                reason="bad_chunk",
            )
        n = len(chunk.data)
        if shard.received + n > shard.end:
            whole = shard.end - shard.start == t.nbytes
            raise InvalidArgument(
                f"{self.where(rank)}: tensor {t.spec.name!r}: "
                + (f"{shard.received + n} bytes received, more than its declared shape {list(t.spec.shape)} of "
                   f"{t.spec.dtype} holds ({t.nbytes} bytes)" if whole else
                   f"a chunk ends at byte {shard.received + n}, beyond the part this rank declared "
                   f"(bytes [{shard.start}, {shard.end}))"),
                reason="bad_chunk",
            )
        if n % MASTER_ITEMSIZE:
            raise InvalidArgument(
                f"{self.where(rank)}: tensor {t.spec.name!r}: a chunk of {n} bytes splits an element "
                f"(chunks carry whole {MASTER_DTYPE} elements of {MASTER_ITEMSIZE} bytes)",
                reason="bad_chunk",
            )
        first = t.received == 0
        shard.received += n
        t.received += n
        if first and self.jobs.residual is not None and self.residual_file is None:
            self.held.add(t.nbytes)  # the new residual of this tensor, in memory
        if t.fmt.scaled:
            if first:
                self.held.add(t.nbytes)  # the gathered master
            self._start(self.jobs.gather_chunk, t, chunk.offset, chunk.data)
            if t.received == t.nbytes:
                self._whole(t)
        else:
            self._start(self.jobs.export_chunk, t, chunk.offset, chunk.data)
        return n

    def _whole(self, t: PushedTensor) -> None:
        """A scaled tensor is all here: export it, or, when it shares a global scale with others, the
        group once they all are."""
        if t.fused is None:
            self._start(self.jobs.export_whole, t, 0, b"")
        elif t.fused.ready():
            t.fused.started = True
            self._start(self.jobs.export_fused, t, 0, b"")

    def _start(self, job: JobFn, t: PushedTensor, byte_offset: int, data: bytes | memoryview) -> None:
        """Queue work for the export thread: one thread, so a tensor's chunks are handled in order.
        Small chunks (many small tensors) go in batches: one hand-over to the thread costs more than
        exporting a small tensor. Their bytes are held from the hand-over (one metric update a batch)."""
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
        self.held.add(n)
        fut = asyncio.get_running_loop().run_in_executor(self.context.executor, self.jobs.run, jobs)
        fut.add_done_callback(lambda _f: self.held.add(-n))
        self.pending.append(fut)

    async def commit(self) -> Committed:
        big = len(self.tensors) >= BIG_MANIFEST  # the checks below are linear in the tensors
        await in_thread(big, self._check_complete)
        self._flush()
        await asyncio.gather(*self.pending)
        self.pending.clear()
        self.context.metrics.export_seconds.labels(self.spec.format, self.spec.rounding).observe(self.jobs.seconds)
        await in_thread(big, self._check_finite)
        version, residual, lag_input = await in_thread(big, self._prepared)
        committed, created = await self.context.committer.commit(version, residual, lag_input, self.part_of)
        self.committed = created
        if created and self.jobs.device_residuals:
            self.jobs.exporter.keep_resident(self.header.model, self.jobs.device_residuals)
        return committed, created

    def _check_complete(self) -> None:
        missing = [t for t in self.tensors.values() if t.received < t.nbytes]
        if missing:
            shown = [f"{t.spec.name!r} has {t.received} of {t.nbytes} bytes" for t in missing[:5]]
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise InvalidArgument(
                f"{self.where()}: commit of an incomplete push: {'; '.join(shown)}{more}",
                reason="incomplete",
            )

    def _check_finite(self) -> None:
        bad = [(t.spec.name, t.nonfinite) for t in self.tensors.values() if t.nonfinite]
        if bad and not self.context.settings.allow_nonfinite:
            listed = ", ".join(f"{n!r} ({c} NaN/Inf)" for n, c in bad[:10])
            more = f" and {len(bad) - 10} more tensors" if len(bad) > 10 else ""
            raise InvalidArgument(
                f"{self.where()}: master has non-finite values in {listed}{more}; "
                "rejected (serve with --allow-nonfinite to accept)",
                reason="nonfinite",
            )

    def _prepared(self) -> tuple[Version, tuple[int | None, rounding.Residual, VersionFile | None] | None,
                                 tuple[Sample, int, bool] | None]:
        """The version to commit, the new ef residual and the lag metrics' input, from the exported
        tensors (linear in the tensors: off the loop for a big push)."""
        manifest = exported_manifest(self.header, self.spec, self.plan)
        version = Version(manifest, b"", self.data, file=self.file)  # its header is made at commit, with the lag
        residual = None
        if self.jobs.residual is not None:
            new = {name: t.new_residual for name, t in self.tensors.items() if t.new_residual is not None}
            residual = (
                self.base_version,
                rounding.Residual(self.header.step, new, self.spec.format, self.spec.scaling),
                self.residual_file,
            )
        return version, residual, self.jobs.lag_input(self.tensors)

    async def close(self) -> None:
        """Release the staging memory; waits for exports already running so none writes after."""
        self.closed = True
        self.batch.clear()
        await asyncio.gather(*self.pending, return_exceptions=True)
        self.pending.clear()
        await in_thread(len(self.tensors) >= BIG_MANIFEST, _let_go, self.tensors, self.shards)
        if len(self.header.tensors) >= BIG_MANIFEST:
            let_go(self.header.tensors, self.plan.slots, self.plan.groups, self.plan.empty)
        self.held.add(-self.held.nbytes)
        files = self.context.files
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
            self.context.pool.give(self.data)
        self.data = self.jobs.data = memoryview(b"")


def _let_go(tensors: dict[str, PushedTensor], shards: dict[int, dict[str, RankShard]]) -> None:
    """Drop a push's objects of each tensor (its gathered master, its residual, its digest, samples
    and shards) one tensor at a time: a few hundred thousand freed at once would hold the GIL, and so
    the event loop, for most of a second."""
    for by_name in shards.values():
        while by_name:
            by_name.popitem()
    while tensors:
        _, t = tensors.popitem()
        t.master = t.new_residual = None


async def open_session(context: PushContext, header: PushHeader,
                       ranks: dict[int, tuple[TensorSpec, ...]]) -> PushSession:
    """Stage the version that `header` declares (whole tensors); `ranks` holds each rank's shards."""
    s, files = context.settings, context.files
    where = subject(header.model, step=header.step)
    if header.owners:  # decide from the latest version the registry holds, as the other owners do
        await context.committer.follower.catch_up(header.model)
    try:
        spec = rounding.ExportSpec(header.format or s.format, header.rounding or s.rounding, s.seed, s.scaling,
                                   s.fp8_pattern)
        if header.adapter is not None:
            spec = spec.unscaled()
    except ValueError as e:
        raise InvalidArgument(f"{where}: {e}", reason="invalid_header") from None
    big = len(header.tensors) >= BIG_MANIFEST
    plan = await in_thread(big, make_plan, header, spec, ranks, where, context.parts.replica_id)
    if files is None:
        recycled = context.pool.take(plan.data_bytes)
        # Mapping fresh pages takes a while: off the loop.
        data = recycled if recycled is not None else await asyncio.to_thread(context.alloc, plan.data_bytes)
        return PushSession(context, header, spec, data, plan, None)
    # The header is known only at commit (checksums, lag): leave room for it before the data.
    room = await in_thread(big, header_room, header, spec, plan)
    # On a full disk the model's oldest versions make room (`Committer.on_disk`).
    model, step, on_disk = header.model, header.step, context.committer.on_disk
    file = await on_disk(model, step, functools.partial(files.stage, model, step, room, plan.data_bytes))
    new_residual = None
    if spec.rounding == "ef":  # the new residual is staged in a file of its own
        numels = {name: t.spec.numel for name, t in plan.tensors.items()}
        try:
            stage = functools.partial(context.committer.residuals.stage, model, step, numels, spec.format,
                                      spec.scaling)
            new_residual = await on_disk(model, step, stage)
        except BaseException:
            await asyncio.to_thread(files.discard, file)
            raise
    # (file.data taken before, this view would keep a discarded file's blocks mapped)
    return PushSession(context, header, spec, file.data, plan, file, new_residual)
