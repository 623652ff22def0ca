"""The version store: committed versions per model, retention, persistence, events and acks.

All methods run on the service's event loop; file writes go to a thread. A `Version` is immutable
once committed; evicting it only drops the store's reference, so a pull that still holds it
finishes from the same bytes.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import mmap
import os
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from weightsvc._faults import crash_point
from weightsvc.core.lag import LagTracker, Sample
from weightsvc.core.manifest import (
    Manifest,
    Part,
    manifest_from_header,
    read_safetensors_header,
    verify,
)
from weightsvc.core.memory import BufferPool
from weightsvc.core.registry import CommitResult, MemoryRegistry, Registry, check_commit, manifest_from_registry
from weightsvc.errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from weightsvc.metrics import Metrics
from weightsvc.rounding import Residual

log = logging.getLogger("weightsvc.store")
T = TypeVar("T")

MAX_CLIENTS_PER_MODEL = 10_000
MAX_HISTORY = 100_000  # committed (version, time) pairs remembered per model, for staleness
CLIENT_TIMEOUT_S = 300.0  # a client that has not acked for this long no longer counts as connected


@dataclass(eq=False)
class Version:
    """A committed version. Its bytes never change; `readers` and `evicted` are the store's."""

    manifest: Manifest
    header: bytes  # the safetensors prefix
    data: memoryview  # the data section (uint8)
    readers: int = 0  # pulls in progress
    evicted: bool = False
    lent: bool = False  # views of `data` were handed to code we do not control: never recycle
    # Sharded replicas: this replica's part of the version (the manifest of its own file; `manifest`
    # is then the whole version's) and where `data` starts in the version's data section.
    part: Manifest | None = None
    offset: int = 0

    @property
    def held(self) -> tuple[int, int]:
        """The byte range [start, end) of the version's data section that this server holds."""
        return self.offset, self.offset + len(self.data)

    @functools.cached_property
    def etag(self) -> str:
        """The HTTP entity tag of this version's file (hashes its header: computed once)."""
        return self.manifest.etag(self.header)

    @property
    def digest(self) -> str:
        """The master digest of what this server committed (its part's, for a part)."""
        return (self.part or self.manifest).master_digest

    @property
    def size(self) -> int:
        """Bytes of the version's safetensors file (of which a part's replica holds the header and its part)."""
        return len(self.header) + self.manifest.data_bytes

    def file_range(self, start: int, end: int, piece: int) -> Iterator[memoryview]:
        """Pieces of at most `piece` bytes covering [start, end) of the safetensors file (for a part:
        a range of the header and the bytes this replica holds)."""
        head = memoryview(self.header)
        skip = len(head) + self.offset  # file offset of data[0]
        while start < end:
            if start < len(head):
                stop = min(end, len(head), start + piece)
                yield head[start:stop]
            else:
                stop = min(end, start + piece)
                yield self.data[start - skip : stop - skip]
            start = stop


@dataclass
class PartOf:
    """This replica's part of a version of sharded replicas: the owners of all its parts, how long to
    wait for theirs, and an event the push sets when its learner gives up."""

    owners: tuple[str, ...]
    timeout: float
    abandoned: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ClientAck:
    client_id: str
    version: int
    acked_unix: float


class VersionStore:
    def __init__(
        self, *, retain: int, data_dir: Path | None, metrics: Metrics, registry: Registry | None = None
    ) -> None:
        self.retain = retain
        self.data_dir = data_dir
        self.metrics = metrics
        # Decides commits and carries events and acks; this store holds the bytes.
        self.registry: Registry = registry if registry is not None else MemoryRegistry()
        self._versions: dict[str, dict[int, Version]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._changed = asyncio.Condition()
        self._clients: dict[str, dict[str, ClientAck]] = {}
        self.pool = BufferPool()
        self._committing: set[asyncio.Future[tuple[Version, bool]]] = set()
        self._acking: set[asyncio.Future[None]] = set()
        self._residuals: dict[str, Residual] = {}
        self._lag: dict[str, LagTracker] = {}
        self._history: dict[str, list[tuple[int, float]]] = {}  # committed versions, in order
        self.replica_id = ""  # this server's id in the topology (set when it registers)
        self._waiting: dict[str, int] = {}  # model -> the version whose part waits for the other owners'
        metrics.watch_clients(self.client_lags)

    # ---- reads -------------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted(m for m, vs in self._versions.items() if vs)

    def latest(self, model: str) -> int | None:
        vs = self._versions.get(model)
        return max(vs) if vs else None

    def versions(self, model: str) -> list[Version]:
        vs = self._versions.get(model)
        if not vs:
            raise NotFound(f"unknown model {model!r}: nothing has been committed for it")
        return [vs[k] for k in sorted(vs)]

    def get(self, model: str, version: int | None) -> Version:
        """A committed version; `None` means the latest."""
        vs = self._versions.get(model)
        if not vs:
            raise NotFound(f"unknown model {model!r}: nothing has been committed for it")
        if version is None:
            return vs[max(vs)]
        if version not in vs:
            kept = ", ".join(map(str, sorted(vs)))
            raise NotFound(f"model {model!r} has no version {version} (retained: {kept})")
        return vs[version]

    def hold(self, version: Version) -> None:
        """A pull starts reading `version`: its buffer stays untouched until `release`."""
        version.readers += 1

    def release(self, version: Version) -> None:
        version.readers -= 1
        if version.evicted and version.readers == 0:
            self._recycle(version)

    def _recycle(self, version: Version) -> None:
        if not version.lent:
            self.pool.give(version.data)

    def check_step(self, model: str, step: int) -> None:
        """A push may target a step above the latest, or an existing one (idempotent re-push)."""
        self._check_not_waiting(model, step)
        latest = self.latest(model)
        if latest is not None and step < latest and step not in self._versions[model]:
            raise FailedPrecondition(
                f"model {model!r}: step {step} is not above the latest version {latest}",
                reason="step_not_above_latest",
            )

    def _check_not_waiting(self, model: str, step: int) -> None:
        """One part of a model waits for the other owners at a time: what follows builds on it."""
        waiting = self._waiting.get(model)
        if waiting is not None:
            raise FailedPrecondition(
                f"model {model!r} step {step}: this replica's part of version {waiting} is waiting for the other "
                "owners' parts; push again once it commits or is withdrawn",
                reason="step_not_above_latest",
            )

    # ---- commit ------------------------------------------------------------------------------

    def residual(self, model: str, format: str, scaling: str) -> Residual:
        """The EF residual an `ef` push of `model` continues from: the one of the latest committed
        version if that version was an `ef` export to the same format, else a fresh (zero) one."""
        r = self._residuals.get(model)
        latest = self.latest(model)
        if r is not None and latest is not None and r.version == latest and (r.format, r.scaling) == (format, scaling):
            return r
        return Residual(format=format, scaling=scaling)

    async def commit(
        self,
        version: Version,
        residual: tuple[int | None, Residual] | None = None,
        lag_input: tuple[Sample, int, bool] | None = None,
        part_of: PartOf | None = None,
    ) -> tuple[Version, bool]:
        """Make `version` visible (with an `ef` push, also its residual, given with the version of the
        residual it started from). Returns (the committed version, created).

        With `part_of`, `version` is this replica's part of a version of sharded replicas: it becomes
        visible when every owner's part is in, or is withdrawn after `part_of.timeout` seconds or once
        `part_of.abandoned` is set, and nothing of it stays.

        Runs to the end even if the pushing stream is cancelled meanwhile: once the file is in
        place the version must also be in memory, or a restart would resurrect a push that the
        learner saw fail.
        """
        if part_of is not None:
            self._check_not_waiting(version.manifest.model, version.manifest.version)
        task = asyncio.ensure_future(self._commit(version, residual, lag_input, part_of))
        self._committing.add(task)
        task.add_done_callback(self._committing.discard)
        return await asyncio.shield(task)

    async def _commit(
        self,
        version: Version,
        residual: tuple[int | None, Residual] | None,
        lag_input: tuple[Sample, int, bool] | None,
        part_of: PartOf | None = None,
    ) -> tuple[Version, bool]:
        m = version.manifest
        if part_of is not None:  # the file holds the part alone, marked as this replica's
            m = dataclasses.replace(m, parts=(Part(self.replica_id, 0, m.data_bytes),))
            version = Version(m, m.safetensors_header(), version.data)
        async with self._locks.setdefault(m.model, asyncio.Lock()):
            vs = self._versions.setdefault(m.model, {})
            existing = vs.get(m.version)
            latest = max(vs) if vs else None
            # Checked here first too: a rejected push must not overwrite this server's files.
            if not check_commit(m.model, m.version, m.master_digest, existing.digest if existing else None, latest):
                assert existing is not None
                return existing, False
            if residual is not None and residual[0] != latest:
                raise FailedPrecondition(
                    f"model {m.model!r} step {m.version}: version {latest} committed while this ef push "
                    f"continued from version {residual[0]}; push again",
                    reason="step_not_above_latest",
                )
            tracker = self._lag.setdefault(m.model, LagTracker())
            before = tracker.snapshot()
            if lag_input is not None:  # the lag metrics go into the manifest, so into the file too
                m = dataclasses.replace(m, lag=tracker.observe(m.version, *lag_input))
                version = Version(m, m.safetensors_header(), version.data)
            try:
                if self.data_dir is not None:
                    # Durable before visible: a version reported committed survives a crash. The
                    # residual goes first, named by its version, so a restart pairs it correctly.
                    if residual is not None:
                        await asyncio.to_thread(self._write_residual, m.model, residual[1])
                        crash_point("commit.residual-written")
                    await asyncio.to_thread(self._write, version)
                    crash_point("commit.version-renamed")
                # The registry decides (with Redis, across replicas) and announces the version.
                if part_of is None:
                    decided = await self._register(m)
                else:
                    decided, version = await self._commit_part(version, part_of)
            except BaseException:
                self._lag[m.model] = before
                if self.data_dir is not None:
                    await asyncio.to_thread(self._unlink_files, m.model, m.version, residual is not None)
                raise
            # Committed meanwhile by another replica; a part already committed is held here from now on.
            if not decided.created and (part_of is None or m.version in vs):
                return vs.get(m.version, version), False
            vs[m.version] = version
            self._remember(m.model, m.version, m.committed_unix)
            if residual is not None:
                self._residuals[m.model] = residual[1]
            evicted = self._evict(m.model)
        self._update_gauges(m.model)
        self.metrics.versions_committed.labels(m.model).inc()
        if m.lag is not None:
            self.metrics.observe_lag(m.model, m.format, m.rounding, m.lag)
        async with self._changed:
            self._changed.notify_all()
        crash_point("commit.visible")
        if self.data_dir is not None and (evicted or residual is not None):
            await asyncio.to_thread(self._unlink, m.model, evicted)
        return version, True

    async def _commit_part(self, part: Version, part_of: PartOf) -> tuple[CommitResult, Version]:
        """Commit this replica's part; wait for the other owners' parts, or withdraw it. Returns the
        registry's decision and the version as served (the whole manifest, this part's bytes).
        Raises only while the version is not committed: once it is, this replica keeps its part."""
        m = part.manifest
        where = f"model {m.model!r} version {m.version}"
        if part_of.abandoned.is_set():
            raise Aborted(f"{where}: the learner abandoned the push; nothing was committed", reason="aborted")
        self._waiting[m.model] = m.version
        try:
            try:
                decided = await self.registry.commit_part(
                    m.model,
                    m.version,
                    self.replica_id,
                    part_of.owners,
                    m.master_digest,
                    json.dumps(m.to_dict()),
                    self.retain,
                )
            except Unavailable as e:  # recorded or not: the registry's answer to a withdraw settles it
                if await self._withdraw(m.model, m.version):
                    raise e from None
                decided = CommitResult(created=True)
            if decided is None:
                arrived = await self._other_parts(m.model, m.version, part_of)
                if not arrived and await self._withdraw(m.model, m.version):
                    if part_of.abandoned.is_set():
                        raise Aborted(
                            f"{where}: the learner abandoned the push (another owner's part failed); this "
                            "replica's part was withdrawn, nothing was committed",
                            reason="aborted",
                        )
                    raise DeadlineExceeded(
                        f"{where}: not every owner of {sorted(part_of.owners)} committed its part within "
                        f"{part_of.timeout:g} s (--push-rank-timeout-s); this replica's part was withdrawn, nothing "
                        "was committed",
                        reason="aborted",
                    )
                decided = CommitResult(created=True)  # (a withdraw too late: the last part came in meanwhile)
        finally:
            self._waiting.pop(m.model, None)
        raw = await self._settled(lambda: self.registry.manifest(m.model, m.version), f"reading {where}")
        if raw is None:
            raise FailedPrecondition(f"{where}: committed, and already retired by newer versions", reason="other")
        served = self._served_part(part, raw)
        if served is None:
            raise DataLoss(f"{where}: the registry's manifest does not hold this replica's part")
        return decided, served

    async def _withdraw(self, model: str, version: int) -> bool:
        """Take this replica's part back: True, or False if the version committed first."""
        return await self._settled(lambda: self.registry.withdraw_part(model, version, self.replica_id),
                                   f"withdrawing its part of model {model!r} version {version}")  # fmt: skip

    @staticmethod
    async def _settled(call: Callable[[], Awaitable[T]], what: str) -> T:
        """The registry's answer, however long it is away: a part's fate must be known before its
        bytes are kept or dropped."""
        while True:
            try:
                return await call()
            except Unavailable as e:
                log.warning("%s: %s; retrying", what, e)
                await asyncio.sleep(1.0)

    async def _other_parts(self, model: str, version: int, part_of: PartOf) -> bool:
        """Wait until the registry commits `version` (True), or until the timeout or the learner
        abandons the push (False)."""

        async def committed() -> bool:
            while True:
                try:
                    async for v in self.registry.events(model, version - 1):
                        return v == version  # a later version first: this one can no longer commit
                except Unavailable:
                    await asyncio.sleep(0.5)  # the deadline still holds

        waiting = [asyncio.ensure_future(committed()), asyncio.ensure_future(part_of.abandoned.wait())]
        try:
            done, _ = await asyncio.wait(waiting, timeout=part_of.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiting:
                w.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        return waiting[0] in done and waiting[0].result() is True

    def _evict(self, model: str) -> list[int]:
        vs = self._versions[model]
        evicted = sorted(vs)[: max(0, len(vs) - self.retain)]
        for v in evicted:
            version = vs.pop(v)
            version.evicted = True
            if version.readers == 0:  # else the last pull to end gives it back
                self._recycle(version)
        return evicted

    def _update_gauges(self, model: str) -> None:
        vs = self._versions.get(model, {})
        self.metrics.retained_versions.labels(model).set(len(vs))
        self.metrics.retained_bytes.labels(model).set(sum(len(v.data) for v in vs.values()))
        if vs:
            self.metrics.latest_version.labels(model).set(max(vs))

    # ---- events and acks ---------------------------------------------------------------------

    async def watch(self, model: str, after: int | None) -> AsyncIterator[Manifest]:
        """Every retained version above `after` (all when None), then each new one as it commits."""
        async for v in self.registry.events(model, -1 if after is None else after):
            # The registry may announce a version a moment before this store shows it.
            async with self._changed:
                await self._changed.wait_for(functools.partial(self._has_at_least, model, v))
            version = self._versions[model].get(v)
            if version is not None:  # else already evicted: a newer one follows
                yield version.manifest

    def _has_at_least(self, model: str, version: int) -> bool:
        latest = self.latest(model)
        return latest is not None and latest >= version

    def _remember(self, model: str, version: int, committed_unix: float) -> None:
        history = self._history.setdefault(model, [])
        history.append((version, committed_unix))
        del history[:-MAX_HISTORY]

    def versions_behind(self, model: str, version: int) -> int:
        """How many committed versions of `model` are newer than `version`."""
        history = self._history.get(model, [])
        return len(history) - bisect.bisect_right(history, (version, math.inf))

    def ack(self, model: str, version: int, client_id: str) -> int:
        latest = self.latest(model)
        if latest is None:
            raise NotFound(f"unknown model {model!r}: nothing has been committed for it")
        if version < 0 or version > latest:
            raise InvalidArgument(f"model {model!r}: cannot ack version {version}, the latest committed is {latest}")
        if not client_id or len(client_id) > 256:
            raise InvalidArgument("ack needs a client_id of 1-256 characters")
        clients = self._clients.setdefault(model, {})
        previous = clients.pop(client_id, None)
        now = time.time()
        clients[client_id] = ClientAck(client_id, version, now)
        while len(clients) > MAX_CLIENTS_PER_MODEL:  # bounded memory: forget the longest-silent
            clients.pop(next(iter(clients)))
        if previous is None or previous.version != version:  # the first ack of this version: synced
            i = bisect.bisect_left(self._history.get(model, []), (version, -math.inf))
            history = self._history.get(model, [])
            if i < len(history) and history[i][0] == version:
                self.metrics.version_sync_seconds.labels(model).observe(max(0.0, now - history[i][1]))
        # Shared with the other replicas when the registry is Redis; an ack is not worth failing
        # for, so an unreachable registry only costs the fleet-wide view of this one.
        task = asyncio.ensure_future(self.registry.ack(model, client_id, version, now))
        self._acking.add(task)
        task.add_done_callback(self._acked)
        return latest

    async def flush_acks(self) -> None:
        """Wait for the acks on their way to the registry."""
        await asyncio.gather(*self._acking, return_exceptions=True)

    def _acked(self, task: asyncio.Future[None]) -> None:
        self._acking.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("ack not recorded in the registry: %s", task.exception())

    def clients(self, model: str) -> list[ClientAck]:
        return list(self._clients.get(model, {}).values())

    def client_lags(self) -> dict[str, list[int]]:
        """Versions behind latest of each connected client, per model (read at every scrape)."""
        horizon = time.time() - CLIENT_TIMEOUT_S
        return {
            model: [self.versions_behind(model, c.version) for c in clients.values() if c.acked_unix >= horizon]
            for model, clients in self._clients.items()
        }

    # ---- persistence -------------------------------------------------------------------------

    def _path(self, model: str, version: int) -> Path:
        assert self.data_dir is not None
        return self.data_dir / "models" / model / f"{version:020d}.safetensors"

    def _write(self, version: Version) -> None:
        m = version.manifest
        path = self._path(m.model, m.version)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(version.header)
                f.write(version.data)
                f.flush()
                os.fsync(f.fileno())
            crash_point("commit.version-written")
            os.replace(tmp, path)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            where = f"model {m.model!r} version {m.version}: cannot persist to {path.parent}"
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted(f"{where}: {e.strerror}", reason="too_large") from None
            raise Unavailable(f"{where}: {e}", reason="other") from None

    def _residual_path(self, model: str, version: int) -> Path:
        return self._path(model, version).with_name(f"residual-{version:020d}.safetensors")

    def _write_residual(self, model: str, residual: Residual) -> None:
        assert residual.version is not None
        path = self._residual_path(model, residual.version)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            residual.save(path)
        except OSError as e:
            raise Unavailable(f"model {model!r}: cannot persist the ef residual to {path.parent}: {e}") from None

    async def _register(self, m: Manifest) -> CommitResult:
        return await self.registry.commit(m.model, m.version, m.master_digest, json.dumps(m.to_dict()), self.retain)

    def _unlink_files(self, model: str, version: int, residual: bool) -> None:
        """The files of a version that did not commit (best effort: the failure itself is reported)."""
        with contextlib.suppress(OSError):
            self._path(model, version).unlink(missing_ok=True)
            if residual:
                self._residual_path(model, version).unlink(missing_ok=True)

    async def sync_registry(self) -> None:
        """After a restart, make the registry and the restored versions agree. A version the registry
        never committed (a crash between the file and the registry) above its latest is dropped; a
        registry that knows nothing of a model (a fresh one, or the embedded one) takes the files."""
        for model, vs in self._versions.items():
            known = await self.registry.versions(model)
            dropped = []
            for v in sorted(vs):
                if vs[v].manifest.parts:  # a part: served again only as part of what the registry holds
                    whole = await self._whole_of(vs[v])
                    # Written before a crash and not committed: taken back, or it could still complete.
                    if whole is None and not await self.registry.withdraw_part(model, v, vs[v].manifest.parts[0].owner):
                        whole = await self._whole_of(vs[v])  # the last part came in meanwhile
                    if whole is None:
                        dropped.append(v)
                    else:
                        vs[v] = whole
                    continue
                if v in known:
                    continue
                if known and v > known[-1]:
                    dropped.append(v)
                    continue
                m = vs[v].manifest
                try:
                    await self._register(m)
                except (AlreadyExists, FailedPrecondition):
                    dropped.append(v)  # retired meanwhile, or replaced: the registry decides
            for v in dropped:
                log.warning("model %s version %d: restored, but not committed in the registry; dropped", model, v)
                vs.pop(v).evicted = True
            if dropped and self.data_dir is not None:
                await asyncio.to_thread(self._unlink, model, dropped)
            self._update_gauges(model)

    async def _whole_of(self, part: Version) -> Version | None:
        """A restored part with the manifest of the version it belongs to, if that committed."""
        raw = await self.registry.manifest(part.manifest.model, part.manifest.version)
        return None if raw is None else self._served_part(part, raw)

    @staticmethod
    def _served_part(part: Version, raw: str) -> Version | None:
        """This replica's part (as in its file) served under the registry's manifest `raw` of the whole
        version, or None when that version holds no such part (another owner, size or digest)."""
        m = part.manifest
        owner = m.parts[0].owner
        whole = manifest_from_registry(raw, f"model {m.model!r} version {m.version}")
        own = next((p for p in whole.parts if p.owner == owner and p.nbytes == m.data_bytes), None)
        if own is None or json.loads(raw).get(owner, {}).get("digest") != m.master_digest:
            return None
        return Version(whole, whole.safetensors_header(), part.data, part=m, offset=own.offset)

    def _unlink(self, model: str, versions: list[int]) -> None:
        for v in versions:
            self._path(model, v).unlink(missing_ok=True)
        # Only the residual of the model's current ef state is kept.
        current = self._residuals.get(model)
        for path in self._path(model, 0).parent.glob("residual-*.safetensors"):
            if current is None or current.version is None or path != self._residual_path(model, current.version):
                path.unlink(missing_ok=True)

    def restore(self) -> int:
        """Load committed versions from the data dir; returns how many. Skips damaged files."""
        if self.data_dir is None:
            return 0
        root = self.data_dir / "models"
        count = 0
        for model_dir in sorted(root.iterdir()) if root.is_dir() else []:
            for tmp in model_dir.glob(".*.tmp"):
                tmp.unlink()  # a write that never reached its rename: never committed
            for path in sorted(model_dir.glob("[0-9]*.safetensors")):
                try:
                    version = self._load(path)
                    m = version.manifest
                    if (m.model, f"{m.version:020d}.safetensors") != (model_dir.name, path.name):
                        raise ValueError(f"its manifest is of model {m.model!r} version {m.version}")
                except Exception as e:  # one damaged file must not take the others down
                    log.error("skipping %s: %s", path, e)
                    continue
                self._versions.setdefault(version.manifest.model, {})[version.manifest.version] = version
                self._remember(version.manifest.model, version.manifest.version, version.manifest.committed_unix)
                count += 1
            model = model_dir.name
            self._restore_residual(model, model_dir)
            if model in self._versions:
                self._unlink(model, self._evict(model))
                self._update_gauges(model)
        return count

    def _restore_residual(self, model: str, model_dir: Path) -> None:
        """Keep the newest residual whose version is committed; an orphan (written just before a
        crash, its version never committed) is dropped, as its version was."""
        committed = self._versions.get(model, {})
        latest = max(committed) if committed else None
        path = model_dir / f"residual-{latest:020d}.safetensors" if latest is not None else None
        # Only the residual of the latest version continues (as in a live process); one of a version
        # that never committed (a crash between the two writes) or of an older one is not used.
        if path is not None and path.exists():
            try:
                self._residuals[model] = Residual.load(path)
            except Exception as e:
                log.error("skipping %s: %s", path, e)

    @staticmethod
    def _load(path: Path) -> Version:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (header_len,) = struct.unpack("<Q", mm[:8])
        start, header = read_safetensors_header(mm[: 8 + min(header_len, 100 << 20)])
        manifest = manifest_from_header(header)
        data = memoryview(mm)[start:]
        if len(data) != manifest.data_bytes:
            raise ValueError(f"data section is {len(data)} bytes, manifest says {manifest.data_bytes}")
        for t in manifest.tensors:
            verify(t.name, data[t.offset : t.offset + t.nbytes], t.checksum, where=str(path))
        return Version(manifest, bytes(mm[:start]), data)
