"""The transport-agnostic core: what happens on push, pull, list, watch and ack.

The gRPC servicer and the HTTP routes translate their requests into these calls and the domain
errors back; nothing about versions, export or metrics lives in them.

A push is staged privately: the served copy is laid out as one data section from the header, each
master tensor is exported into its slot as soon as its last byte arrives (in a worker thread,
overlapping the receipt of the next tensors), and only `commit` makes the version visible. If the
stream breaks, times out or is rejected, the staging buffers are dropped and nothing is visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from weightsvc import rounding
from weightsvc._manifest import (
    DTYPE_SIZES,
    MASTER_DTYPE,
    SERVED_DTYPE_NAMES,
    Manifest,
    ServedTensor,
    TensorSpec,
    check_model_name,
    checksum,
    layout,
)
from weightsvc._settings import Settings
from weightsvc._store import ClientAck, Version, VersionStore
from weightsvc.errors import Cancelled, InvalidArgument, WeightsvcError
from weightsvc.metrics import Metrics

log = logging.getLogger("weightsvc.service")

MAX_TENSORS = 1_000_000
MAX_NAME_CHARS = 1024
# Tensors received but not yet exported, per push: bounds staging memory, and pushes back on the
# learner (gRPC flow control) when export is slower than the network.
MAX_PENDING_EXPORTS = 2


@dataclass(frozen=True)
class PushHeader:
    model: str
    step: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class PushChunk:
    tensor: str
    offset: int
    data: bytes


@dataclass(frozen=True)
class PushCommit:
    pass


PushMessage = PushHeader | PushChunk | PushCommit


@dataclass
class _Exported:
    checksum: str
    master_digest: str
    nonfinite: int
    saturated: int


class _StagedTensor:
    def __init__(self, spec: TensorSpec, slot: ServedTensor) -> None:
        self.spec = spec
        self.slot = slot
        self.nbytes = spec.numel * DTYPE_SIZES[spec.dtype]
        self.received = 0
        self.master: torch.Tensor | None = None
        self.export: asyncio.Future[_Exported] | None = None


class PushSession:
    """One learner's push, from header to commit. Owns its staging memory until it ends."""

    def __init__(self, service: Service, header: PushHeader) -> None:
        self.service = service
        self.header = header
        self.spec = service.settings.export_spec
        slots, self.data_bytes = layout(list(header.tensors), SERVED_DTYPE_NAMES[self.spec.format])
        self.tensors = {s.name: _StagedTensor(s, slot) for s, slot in zip(header.tensors, slots)}
        self.data = torch.empty(self.data_bytes, dtype=torch.uint8)
        self.staged_bytes = self.data_bytes
        service.metrics.staged_bytes.inc(self.staged_bytes)
        self.pending: list[asyncio.Future[_Exported]] = []
        for t in self.tensors.values():
            if t.nbytes == 0:
                self._start_export(t, torch.empty(t.spec.shape, dtype=torch.float32))

    def _where(self) -> str:
        return f"model {self.header.model!r} step {self.header.step}"

    async def add_chunk(self, chunk: PushChunk) -> None:
        t = self.tensors.get(chunk.tensor)
        if t is None:
            raise InvalidArgument(
                f"{self._where()}: chunk for undeclared tensor {chunk.tensor!r}", reason="bad_chunk"
            )
        if chunk.offset != t.received:
            raise InvalidArgument(
                f"{self._where()}: tensor {t.spec.name!r}: chunk at byte offset {chunk.offset}, expected "
                f"{t.received} (the chunks of a tensor arrive in order, without gaps or overlaps)",
                reason="bad_chunk",
            )
        n = len(chunk.data)
        if t.received + n > t.nbytes:
            raise InvalidArgument(
                f"{self._where()}: tensor {t.spec.name!r}: {t.received + n} bytes received, more than "
                f"its declared shape {list(t.spec.shape)} of {t.spec.dtype} holds ({t.nbytes} bytes)",
                reason="bad_chunk",
            )
        if t.master is None:
            t.master = torch.empty(t.spec.numel, dtype=torch.float32)
            self._stage(t.nbytes)
        t.master.view(torch.uint8).numpy()[t.received : t.received + n] = np.frombuffer(chunk.data, np.uint8)
        t.received += n
        self.service.metrics.push_bytes.labels(self.header.model).inc(n)
        if t.received == t.nbytes:
            master, t.master = t.master.view(t.spec.shape), None
            self._start_export(t, master)
            while sum(not f.done() for f in self.pending) > MAX_PENDING_EXPORTS:
                await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)

    def _stage(self, nbytes: int) -> None:
        self.staged_bytes += nbytes
        self.service.metrics.staged_bytes.inc(nbytes)

    def _start_export(self, t: _StagedTensor, master: torch.Tensor) -> None:
        loop = asyncio.get_running_loop()
        t.export = loop.run_in_executor(self.service.executor, self._export, t, master)
        self.pending.append(t.export)
        # The master's bytes are freed by the worker once exported; count them out there.
        t.export.add_done_callback(lambda _f, n=t.nbytes: self._stage(-n) if t.nbytes else None)

    def _export(self, t: _StagedTensor, master: torch.Tensor) -> _Exported:
        """Worker thread: Fair Cast into the tensor's slot, then checksum served and master bytes."""
        start = time.perf_counter()
        slot = t.slot
        served = self.data[slot.offset : slot.offset + slot.nbytes].view(self.spec.served_dtype)
        stats = rounding.export(
            master.reshape(-1), served, self.spec, version=self.header.step, name=t.spec.name
        )
        result = _Exported(
            checksum=checksum(self.data[slot.offset : slot.offset + slot.nbytes].numpy()),
            master_digest=xxhash.xxh3_128_hexdigest(master.reshape(-1).view(torch.uint8).numpy()),
            nonfinite=stats.nonfinite,
            saturated=stats.saturated,
        )
        self.service.metrics.export_seconds.labels(self.spec.format, self.spec.rounding).observe(
            time.perf_counter() - start
        )
        return result

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
        done = {name: t.export.result() for name, t in self.tensors.items()}  # type: ignore[union-attr]
        bad = [(n, e.nonfinite) for n, e in done.items() if e.nonfinite]
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
        for name in sorted(done):
            h.update(f"{name}\x00{list(self.tensors[name].spec.shape)}\x00{done[name].master_digest}\n".encode())
        manifest = Manifest(
            model=self.header.model,
            version=self.header.step,
            format=self.spec.format,
            rounding=self.spec.rounding,
            seed=self.spec.seed,
            committed_unix=time.time(),
            data_bytes=self.data_bytes,
            master_digest="xxh3_128:" + h.hexdigest(),
            tensors=tuple(
                ServedTensor(**{**t.slot.__dict__, "checksum": done[name].checksum})
                for name, t in self.tensors.items()
            ),
        )
        saturated = sum(e.saturated for e in done.values())
        version = Version(manifest, manifest.safetensors_header(), memoryview(self.data.numpy()), self.data)
        committed, created = await self.service.store.commit(version)
        if created and saturated:
            self.service.metrics.saturated_elements.labels(manifest.model, manifest.format).inc(saturated)
        return committed, created

    async def close(self) -> None:
        """Release the staging memory; waits for exports already running so none writes after."""
        await asyncio.gather(*self.pending, return_exceptions=True)
        for t in self.tensors.values():
            t.master = None
        self.service.metrics.staged_bytes.dec(self.staged_bytes)
        self.staged_bytes = 0
        self.data = torch.empty(0, dtype=torch.uint8)


def validate_header(header: PushHeader) -> None:
    check_model_name(header.model)
    where = f"model {header.model!r} step {header.step}"
    if header.step < 0:
        raise InvalidArgument(f"{where}: step must be >= 0", reason="invalid_header")
    if not header.tensors:
        raise InvalidArgument(f"{where}: the push declares no tensors", reason="invalid_header")
    if len(header.tensors) > MAX_TENSORS:
        raise InvalidArgument(f"{where}: more than {MAX_TENSORS} tensors", reason="too_large")
    seen: set[str] = set()
    for t in header.tensors:
        if not t.name or len(t.name) > MAX_NAME_CHARS:
            raise InvalidArgument(
                f"{where}: tensor names must have 1-{MAX_NAME_CHARS} characters", reason="invalid_header"
            )
        if t.name in seen:
            raise InvalidArgument(f"{where}: tensor {t.name!r} is declared twice", reason="invalid_header")
        seen.add(t.name)
        if t.dtype not in DTYPE_SIZES:
            raise InvalidArgument(
                f"{where}: tensor {t.name!r} has unknown dtype {t.dtype!r} "
                f"(known: {', '.join(DTYPE_SIZES)})",
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


class Service:
    """The core shared by every transport: settings, store, metrics and the export workers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.store = VersionStore(retain=settings.retain, data_dir=settings.data_dir, metrics=self.metrics)
        # One export at a time: the kernel itself uses every core.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsvc-export")
        self._pushes: set[PushSession] = set()
        self._pushes_changed = asyncio.Condition()

    def restore(self) -> int:
        return self.store.restore()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    # ---- push --------------------------------------------------------------------------------

    async def push(self, messages: AsyncIterator[PushMessage]) -> tuple[Version, bool]:
        """Run one push stream: header, chunks, commit. Nothing is visible unless it commits."""
        session: PushSession | None = None
        idle = self.settings.push_idle_timeout_s
        self.metrics.pushes_in_flight.inc()
        try:
            header = await self._next(messages, idle)
            if not isinstance(header, PushHeader):
                raise InvalidArgument("a push must start with its header", reason="invalid_header")
            validate_header(header)
            self.store.check_step(header.model, header.step)
            session = PushSession(self, header)
            self._pushes.add(session)
            while True:
                msg = await self._next(messages, idle)
                if isinstance(msg, PushChunk):
                    await session.add_chunk(msg)
                elif isinstance(msg, PushCommit):
                    version, created = await session.commit()
                    break
                elif msg is None:
                    raise Cancelled(f"{session._where()}: the stream ended without a commit", reason="aborted")
                else:
                    raise InvalidArgument(f"{session._where()}: a second header", reason="invalid_header")
            log.info(
                "%s model=%s version=%d tensors=%d bytes=%d",
                "committed" if created else "idempotent push of",
                header.model, header.step, len(header.tensors), session.data_bytes,
            )
            return version, created
        except WeightsvcError as e:
            self.metrics.pushes_rejected.labels(e.reason).inc()
            raise
        except (asyncio.CancelledError, TimeoutError):
            self.metrics.pushes_rejected.labels("aborted").inc()
            raise
        finally:
            self.metrics.pushes_in_flight.dec()
            if session is not None:
                await session.close()
                self._pushes.discard(session)
                async with self._pushes_changed:
                    self._pushes_changed.notify_all()

    @staticmethod
    async def _next(messages: AsyncIterator[PushMessage], idle: float) -> PushMessage | None:
        try:
            return await asyncio.wait_for(anext(messages), idle)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise Cancelled(f"push stalled: nothing received for {idle:g} s", reason="aborted") from None

    async def wait_no_pushes(self) -> None:
        """Return once no push is staged (their memory released)."""
        async with self._pushes_changed:
            await self._pushes_changed.wait_for(lambda: not self._pushes)

    # ---- reads -------------------------------------------------------------------------------

    def models(self) -> list[dict[str, object]]:
        out = []
        for model in self.store.models():
            vs = self.store.versions(model)
            out.append({"model": model, "latest_version": vs[-1].manifest.version,
                        "versions": [v.manifest.version for v in vs]})
        return out

    def versions(self, model: str) -> list[Manifest]:
        return [v.manifest for v in self.store.versions(model)]

    def manifest(self, model: str, version: int | None) -> Manifest:
        return self.store.get(model, version).manifest

    @contextlib.contextmanager
    def pulling(self, model: str, version: int | None, transport: str) -> Iterator[Version]:
        """Hold a version for the length of a pull; eviction cannot free it meanwhile."""
        held = self.store.get(model, version)
        gauge = self.metrics.pulls_in_flight.labels(transport)
        gauge.inc()
        try:
            yield held
        finally:
            gauge.dec()

    def count_pulled(self, model: str, transport: str, nbytes: int) -> None:
        self.metrics.pull_bytes.labels(model, transport).inc(nbytes)

    def watch(self, model: str, after: int | None) -> AsyncIterator[Manifest]:
        check_model_name(model)
        return self.store.watch(model, after)

    def ack(self, model: str, version: int, client_id: str) -> int:
        return self.store.ack(model, version, client_id)

    def clients(self, model: str) -> list[ClientAck]:
        return self.store.clients(model)
