"""`--object-store`: every committed version written through to an object store, and a server that
starts with no versions restored from it.

A version goes to the store as a full version every `--full-every` versions and as a delta on the
one before it in between (`store.writer`), its commit marker last; the store keeps what the server
retains (`--retain`) and the deltas those are built on. A store that is slow or down holds up no
commit and no pull: committed versions wait in a bounded queue (`weightsvc_store_uploads_queued`),
each upload that fails is tried again with backoff, and when the queue is full the oldest waiting
version is dropped with a warning (the next upload is then a full version). With
`--object-store-required` a commit uploads its version first instead, and fails if that does.

Sharded replicas publish too, each version once for the cluster: the first (by id) of the replicas
that hold its parts does, with its parts gathered from their holders (`Gather`, at its commit; each
replica tells from the version alone whether it is the one). --object-store-required is a single
server's: a version of parts is whole only once it is committed.

Loop-owned; uploads run in one worker thread of their own, in commit order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from weightsvc.errors import (
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    DiskFull,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    WeightsvcError,
    subject,
)
from weightsvc.metrics import Metrics
from weightsvc.protocol.delta import compatible
from weightsvc.protocol.digest import verify_data
from weightsvc.protocol.manifest import Manifest, check_manifest
from weightsvc.service.versions.index import Version, VersionIndex
from weightsvc.settings import Settings
from weightsvc.store import Bucket, Marker, StoreReader, StoreUrl
from weightsvc.store.layout import Damaged, marker_name
from weightsvc.store.writer import StoredModel, check_new, expired, remove, write_version

log = logging.getLogger("weightsvc.store")
T = TypeVar("T")
# A version of sharded replicas, whole: its parts pulled from their holders (blocking; the server's).
Gather = Callable[[str, int], tuple[Manifest, memoryview]]
# Errors that say nothing of a version in the store, only that it cannot be read or kept now.
_NOT_THE_VERSION = (Unavailable, Unauthenticated, PermissionDenied, DeadlineExceeded, DiskFull)


class Publisher:
    def __init__(self, settings: Settings, metrics: Metrics, index: VersionIndex, gather: Gather | None = None) -> None:
        assert settings.object_store is not None
        self.url = StoreUrl.parse(settings.object_store)
        self._bucket: Bucket | None = None  # opened by `open`, off the loop (boto3 takes a second to load)
        self._reader: StoreReader | None = None
        self._gather = gather
        self.damaged: list[Damaged] = []  # what restore found in the store that is no version, set aside
        self.required = settings.object_store_required
        self.full_every = settings.full_every
        self.bound = settings.object_store_queue
        self.retain = settings.retain
        self.max_backoff_s = 10.0  # between tries of an upload that failed
        self._index = index
        self._metrics = metrics
        self._stored: dict[str, StoredModel] = {}  # what the store holds, per model, as this server knows it
        # The last version uploaded of each model, held (as a pull holds a version) for the next delta
        # to be on, should retention evict it while the next upload waits.
        self._bases: dict[str, Version] = {}
        self._waiting: collections.deque[Version] = collections.deque()
        self._uploading: Version | None = None
        self._wake = asyncio.Event()
        self._tried = asyncio.Condition()  # notified after each upload tried, done or failed
        self.failures = 0  # uploads that failed, in a row
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="weightsvc-store")
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        self._bucket = await asyncio.to_thread(Bucket, self.url)
        self._reader = StoreReader(self._bucket)

    @property
    def bucket(self) -> Bucket:
        assert self._bucket is not None, "the publisher is not open"
        return self._bucket

    @property
    def reader(self) -> StoreReader:
        assert self._reader is not None, "the publisher is not open"
        return self._reader

    def start(self) -> None:
        self._task = asyncio.create_task(self._drain(), name="store-uploads")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._waiting:
            log.warning("stopping with %d versions not yet in the object store %s: %s", len(self._waiting), self.url,
                        ", ".join(_named(v) for v in self._waiting))
        for version in [*self._waiting, *self._bases.values()]:
            self._index.release(version)
        self._waiting.clear()
        self._bases.clear()
        # An upload under way is not waited for (its version is not in the store: it has no marker).
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self._bucket is not None and self._uploading is None:
            self._bucket.close()

    # ---- the committer's calls ----------------------------------------------------------------

    async def before_commit(self, version: Version) -> None:
        """With --object-store-required: upload `version` now (the caller holds its model's lock); its
        errors are the commit's."""
        if self.required:
            await self._write(version)

    def committed(self, version: Version) -> None:
        """`version` is committed (and in the index): queue its upload (with --object-store-required it
        is in the store already: the next delta is on it). Of a version of sharded replicas, only the
        replica that publishes it does (`publishes`)."""
        if version.part is not None and not publishes(version):
            return
        if self.required:
            self._keep_base(version)
            return
        if len(self._waiting) >= self.bound:
            dropped = self._waiting.popleft()
            self._index.release(dropped)
            self._metrics.store_dropped.inc()
            log.warning("the object store %s is behind by %d versions (--object-store-queue): %s dropped, never to "
                        "be uploaded", self.url, self.bound, _named(dropped))
        self._index.hold(version)  # its bytes stay as they are until uploaded
        self._waiting.append(version)
        self._metrics.store_queued.set(self.queued)
        self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._waiting) + (self._uploading is not None)

    async def drained(self) -> None:
        """Return once every queued version is in the store (or dropped)."""
        async with self._tried:
            await self._tried.wait_for(lambda: self.queued == 0)

    async def failed(self) -> None:
        """Return once an upload has failed (since the last that went)."""
        async with self._tried:
            await self._tried.wait_for(lambda: self.failures > 0)

    # ---- uploads ------------------------------------------------------------------------------

    async def _drain(self) -> None:
        while True:
            async with self._tried:
                self._tried.notify_all()
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            version = self._uploading = self._waiting.popleft()
            try:
                self._keep_base(await self._write(version) or version)
                self.failures = 0
            except (AlreadyExists, DataLoss) as e:  # trying again cannot help
                log.error("%s cannot go to the object store %s: %s", _named(version), self.url, e)
            except Exception as e:
                self.failures += 1
                self._metrics.store_failures.inc()
                delay = min(self.max_backoff_s, 0.25 * 2 ** (self.failures - 1))
                log.warning("upload of %s to the object store failed (try %d; again in %.1f s): %s", _named(version),
                            self.failures, delay, e, exc_info=None if isinstance(e, WeightsvcError | OSError) else e)
                self._waiting.appendleft(version)  # the oldest waiting again: the bound may drop it
                self._uploading = None
                self._wake.clear()
                async with self._tried:
                    self._tried.notify_all()
                with contextlib.suppress(TimeoutError):  # a new commit tries again at once: the store may be back
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            self._uploading = None
            self._index.release(version)
            self._metrics.store_queued.set(self.queued)

    async def _write(self, version: Version) -> Version | None:
        """Upload `version` (a delta on the store's latest of its model when that can be), then apply the
        store's retention. Returns the version as uploaded (one of sharded replicas gathered whole), or
        None when it was not: in the store already, older than what it holds, or retired before its
        parts could be gathered."""
        m = version.manifest
        # What the store holds, listed again (another replica may have published since): its versions
        # that can be built (a marker whose objects are missing must not stop the uploads).
        stored = self._stored[m.model] = StoredModel(await self._run(self.reader.markers, m.model))
        latest = stored.latest
        if (latest is not None and m.version < latest.version) or not check_new(stored, m):
            return None
        if version.part is not None:
            whole = await self._whole(version)
            if whole is None:
                return None
            version = whole
        base = self._base(latest, version.manifest)
        marker: Marker = await self._run(write_version, self.bucket, version.manifest, version.header, version.data,
                                         None if base is None or latest is None else (latest, base.data))
        stored.markers[m.version] = marker
        self.reader.wrote(marker)
        self._metrics.store_uploads.labels(marker.kind).inc()
        self._metrics.store_bytes.labels(marker.kind).inc(marker.nbytes)
        log.info("object store: model=%s version=%d kind=%s bytes=%d", m.model, m.version, marker.kind, marker.nbytes)
        gone = expired(stored, self.retain)
        if gone:
            await self._run(remove, self.bucket, stored, gone)
        return version

    async def _whole(self, version: Version) -> Version | None:
        """A version of sharded replicas whole, as a relay of them would commit it: its parts gathered
        from their holders and verified (None: retired meanwhile)."""
        m = version.manifest
        assert self._gather is not None, "sharded replicas publish with the server's gather"
        try:
            pulled: tuple[Manifest, memoryview] = await self._run(self._gather, m.model, m.version)
        except NotFound as e:
            log.warning("%s was retired before its parts could be gathered for the object store %s: %s",
                        _named(version), self.url, e)
            return None
        gathered, data = pulled
        if (gathered.model, gathered.version, gathered.master_digest) != (m.model, m.version, m.master_digest):
            raise DataLoss(f"{_named(version)}: its parts were gathered as {subject(gathered.model, gathered.version)} "
                           f"of master digest {gathered.master_digest}, not {m.master_digest}")
        whole = dataclasses.replace(gathered, parts=())
        await self._run(verify_data, whole, data)
        return Version(whole, await self._run(whole.safetensors_header), data)

    def _keep_base(self, version: Version) -> None:
        """Hold `version`, committed and the store's latest of its model, as the next delta's base (a
        version that failed to commit after its upload is never one: its buffer goes back)."""
        m = version.manifest
        stored = self._stored.get(m.model)
        if stored is None or stored.latest is None or stored.latest.version != m.version:
            return
        self._index.hold(version)
        before = self._bases.pop(m.model, None)
        if before is not None:
            self._index.release(before)
        self._bases[m.model] = version

    def _base(self, latest: Marker | None, m: Manifest) -> Version | None:
        """The version a delta of `m` is on: the store's latest of the model, when its chain is shorter
        than --full-every, this server retains it, and it has the same layout."""
        if latest is None or latest.chain + 1 >= self.full_every:
            return None
        held = self._bases.get(m.model)
        if held is None or held.manifest.version != latest.version:
            held = self._index.find(m.model, latest.version)
        if held is None or held.part is not None or not compatible(held.manifest, m):
            return None  # (a part of a version of sharded replicas is no base: a gathered version is)
        return held

    async def _run(self, call: Any, *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, call, *args)  # type: ignore[no-any-return]


def publishes(version: Version) -> bool:
    """Whether this replica publishes `version`, of sharded replicas (this replica holds a part of it):
    the first by id of the replicas that hold its parts does, so each replica tells from the version
    alone, and each version is published once for the cluster."""
    assert version.part is not None
    holders = {h for p in version.manifest.parts for h in p.sources}
    return bool(version.part.parts) and version.part.parts[0].owner == min(holders, default="")


def _named(version: Version) -> str:
    return subject(version.manifest.model, version.manifest.version)


async def restore(publisher: Publisher, settings: Settings, mirror: Callable[[Manifest, memoryview], Awaitable[None]],
                  wanted: Callable[[Manifest], Awaitable[bool]] | None = None) -> int:
    """Bring back the versions the store retains of every model (the newest --retain that can be
    built), oldest first, each rebuilt from its chain (on the one before it where it can), verified,
    and committed by `mirror` as a relay commits; returns how many. The ef residual is not in the
    store: the next ef push starts from a zero residual. `wanted`: whether a version is one to bring
    back (None: every one).

    Version by version, as the data dir's restore: one that is damaged (its marker, its object, the
    chain it is built on, a manifest this server refuses) is set aside, logged and listed in
    `publisher.damaged`, and the rest are served; a folder no model can be named after, too. A store
    that cannot be read at all (down, or refusing the credentials) fails the start."""
    reader = publisher.reader
    s = settings
    count = 0

    def check(m: Manifest) -> Manifest:
        return check_manifest(m, max_bytes=s.max_version_bytes, max_tensors=s.max_tensors)

    def load(marker: Marker, held: tuple[Manifest, memoryview] | None) -> tuple[Manifest, memoryview]:
        data = reader.load(marker, held, lambda n: None, check)
        verify_data(marker.manifest, data)
        return marker.manifest, data

    aside: list[Damaged] = []
    for model in await asyncio.to_thread(reader.models):
        markers = await asyncio.to_thread(reader.markers, model)  # (a damaged version takes no place)
        held = None
        for version in sorted(markers)[-s.retain :]:
            try:
                if wanted is not None and not await wanted(markers[version].manifest):
                    continue
                loaded = await asyncio.to_thread(load, markers[version], held)
                await mirror(*loaded)
            except _NOT_THE_VERSION:
                raise
            except Exception as e:  # one damaged version must not take the others down
                aside.append(Damaged(model, marker_name(model, version), str(e) or type(e).__name__))
                continue
            held = loaded
            count += 1
    aside = await asyncio.to_thread(reader.damaged) + aside
    for damaged in aside:
        log.error("object store %s: %s of model %r is damaged, set aside: %s", publisher.url, damaged.name,
                  damaged.model, damaged.reason)
    publisher.damaged += aside
    return count
