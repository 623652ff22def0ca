"""Publishes in progress, and the one owner of each one's fate.

Each learner rank sends one request: its part of the served copy it exported, registered with its
NIXL agent. The ranks of one (model, step) join one `Copying`; once every rank is in, their requests
are checked together (checks.py), a buffer of the staging budget is taken, every rank's bytes are
READ into it with the server's agent (`Lender.read`) and checked against that rank's checksums, and
the version commits through the committer as any version does (relays, delta pulls, the object
store and NIXL leases then serve it unchanged). Every rank's call answers with the outcome; until
then the learner keeps its memory registered and unchanged. Whatever fails — a rank that never
comes (--push-rank-timeout-s), a rank whose call ends (its process died), a READ, a checksum —
fails every rank at once, naming it, and nothing is visible.

Loop-owned, but the READs, which run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import xxhash

from weightsvc import rounding
from weightsvc._aio import BIG_MANIFEST, in_thread
from weightsvc.errors import (
    Aborted,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    WeightsvcError,
    subject,
)
from weightsvc.memory import BufferPool, alloc
from weightsvc.metrics import Metrics
from weightsvc.protocol.digest import CHECKSUM_PREFIX, checksum
from weightsvc.protocol.fabric import PIECE, Piece, cut_pieces
from weightsvc.protocol.lag import LagSums, combine
from weightsvc.protocol.manifest import Manifest, ServedTensor
from weightsvc.protocol.published import RankPublish
from weightsvc.service.copies.checks import CopyPlan, check_rank, plan_copy, server_spec
from weightsvc.service.lender import Lender, address
from weightsvc.service.push.budget import StagingBudget
from weightsvc.service.push.validate import missing_ranks
from weightsvc.service.record import Version
from weightsvc.service.replicas.registry import not_above
from weightsvc.service.versions.commit import Committer
from weightsvc.service.versions.index import VersionIndex
from weightsvc.settings import Settings

log = logging.getLogger("weightsvc.publish")

Committed = tuple[Version, bool]


class Copying:
    """The ranks publishing one (model, step), and the one owner of that publish's fate: ranks join,
    the last one starts the copy, and every rank answers with its outcome. `fail` is the only way it
    fails, and it fails every rank."""

    def __init__(self, copies: Copies, first: RankPublish) -> None:
        self.copies = copies
        self.model, self.step, self.world_size = first.model, first.step, first.world_size
        self.where = subject(first.model, step=first.step)
        self.timeout = copies.settings.push_rank_timeout_s
        self.deadline = time.monotonic() + self.timeout
        self.ranks: dict[int, RankPublish] = {}
        loop = asyncio.get_running_loop()
        self.joined: asyncio.Future[None] = loop.create_future()
        self.result: asyncio.Future[Committed] = loop.create_future()  # what every rank answers
        self.task: asyncio.Future[None] | None = None  # the copy, started by the last rank to join
        self.failure: WeightsvcError | None = None
        self.committing = False  # from here on the commit decides, whatever happens to the ranks

    def join(self, p: RankPublish) -> None:
        """Add a rank's request; the last one missing starts the copy."""
        if p.world_size != self.world_size:
            raise InvalidArgument(f"{p.where}: world_size {p.world_size}, but the publish in progress has world_size "
                                  f"{self.world_size}", reason="invalid_header")
        if p.rank in self.ranks:
            raise InvalidArgument(f"{p.where}: this rank is already publishing", reason="invalid_header")
        self.ranks[p.rank] = p
        if len(self.ranks) == self.world_size:
            self.joined.set_result(None)
            self.task = asyncio.ensure_future(self._copy())

    async def wait(self, rank: int) -> Committed:
        """This rank's answer: the committed version, once every rank is in and the copy committed."""
        try:
            if not self.joined.done():
                try:
                    async with asyncio.timeout(self.deadline - time.monotonic()):
                        await asyncio.shield(self.joined)
                except TimeoutError:
                    shown = missing_ranks(self.world_size, self.ranks)
                    self.fail(DeadlineExceeded(
                        f"{self.where}: rank(s) {shown} of world_size {self.world_size} did not publish within "
                        f"{self.timeout:g} s (--push-rank-timeout-s); nothing was committed", reason="aborted"))
                    assert self.failure is not None
                    raise self.failure from None
            return await asyncio.shield(self.result)
        except asyncio.CancelledError:
            self.fail(Aborted(f"{subject(self.model, step=self.step, rank=rank)}: its publish call ended before the "
                              "version committed (the learner rank went away); nothing was committed",
                              reason="aborted"))
            raise

    def fail(self, error: WeightsvcError) -> None:
        """Fail every rank with `error` (the first failure is the one reported), unless the commit has
        begun: then it decides."""
        if self.failure is not None or self.committing or self.result.done():
            return
        self.failure = error
        log.warning("publish failed: %s", error.message)
        for future in (self.joined, self.result):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: the ranks may all be gone
        self.copies.forget(self)

    async def _copy(self) -> None:
        """Check the ranks together, READ every rank's bytes into a buffer of the staging budget, check
        them, commit. Runs to its end (a READ in a worker thread cannot be called back): a failure
        meanwhile is answered at once, and this only lets go of what it holds."""
        copies, settings = self.copies, self.copies.settings
        big = sum(len(p.tensors) for p in self.ranks.values()) >= BIG_MANIFEST
        reserved = 0
        data: memoryview | None = None
        kept = False
        try:
            plan = await in_thread(big, plan_copy, self.where, self.ranks, server_spec(settings),
                                   settings.max_version_bytes)
            reserved = copies.budget.reserve(self.where, plan.data_bytes)
            data = copies.pool.take(plan.data_bytes)
            if data is None:
                data = await asyncio.to_thread(alloc, plan.data_bytes)  # (mapping fresh pages takes a while)
            whole, read = await asyncio.to_thread(self._read, plan, data)
            manifest = await in_thread(big, self._manifest, plan, data, whole)
            if self.failure is not None:  # a rank went away meanwhile: its version is not to be seen
                return
            self.committing = True
            version, created = await copies.committer.commit(Version(manifest, b"", data), lag_sums=self._lag())
            kept = created and version.file is None  # (with a data dir the version is served from its file)
            copies.metrics.publish_bytes.labels(self.model).inc(read)
            if not self.result.done():
                self.result.set_result((version, created))
            copies.forget(self)
        except WeightsvcError as e:
            self.committing = False
            self.fail(e)
        except asyncio.CancelledError:
            data = None  # (a READ may still be landing in it: never recycled)
            self.committing = False
            self.fail(Aborted(f"{self.where}: the server stopped while copying the publish", reason="aborted"))
            raise
        except Exception as e:
            log.error("%s: the copy of a publish failed unexpectedly", self.where, exc_info=e)
            self.committing = False
            self.fail(Internal(f"{self.where}: the copy failed: {type(e).__name__}: {e}; nothing was committed",
                               reason="internal"))
        finally:
            if data is not None and not kept:
                copies.pool.give(data)
            copies.budget.give_back(reserved)

    def _lag(self) -> LagSums | None:
        """The version's lag sums, its ranks' added up: None unless every rank sent its own (a rank of an
        older client sends none), or when they were measured from different versions (a rank whose lag
        state was lost: it restarted); the version commits all the same, without lag."""
        sent = {rank: p.lag for rank, p in self.ranks.items() if p.lag is not None}
        if not sent:
            return None
        if len(sent) < len(self.ranks):
            log.warning("%s: no lag metrics: rank(s) %s sent lag sums, rank(s) %s did not", self.where,
                        sorted(sent), sorted(set(self.ranks) - set(sent)))
            return None
        try:
            return combine([sent[rank] for rank in sorted(sent)])
        except ValueError as e:
            log.warning("%s: no lag metrics: the ranks' lag sums do not add up (ranks in rank order): %s",
                        self.where, e)
            return None

    def _read(self, plan: CopyPlan, data: memoryview) -> tuple[dict[str, str], int]:
        """READ each rank's parts into their places in `data` and check each part against its rank's
        checksum (hashed as its pieces land). Answers the checksums of the tensors one part holds whole
        (the version's own), and the bytes that landed. Blocking: a worker thread."""
        lender, settings = self.copies.lender(), self.copies.settings
        at = address(data)
        whole: dict[str, str] = {}
        landed = [0]
        for rank in sorted(self.ranks):
            if self.failure is not None:  # (another rank failed meanwhile: the others need not be read)
                raise self.failure
            p = self.ranks[rank]
            starts = {t.name: plan.slots[t.name].offset + t.elements[0] * t.itemsize for t in p.tensors}
            sums = {t.name: xxhash.xxh3_64() for t in p.tensors}

            def hashed(piece: Piece, starts: dict[str, int] = starts, sums: dict[str, xxhash.xxh3_64] = sums) -> None:
                for name, start, end in piece.spans:
                    sums[name].update(data[starts[name] + start : starts[name] + end])
                    landed[0] += end - start

            pieces = cut_pieces(((t.name, at + starts[t.name], 0, t.ranges) for t in p.tensors if t.ranges), PIECE)
            if pieces:
                deadline = time.monotonic() + settings.push_idle_timeout_s + p.nbytes / settings.push_min_bytes_per_s
                lender.read(p.agent, p.memory, data, pieces, deadline=deadline, where=p.where, source=f"rank {rank}",
                            done=hashed)
            for t in p.tensors:
                got = CHECKSUM_PREFIX + sums[t.name].hexdigest()
                if got != t.checksum:
                    raise DataLoss(f"{subject(self.model, step=self.step, tensor=t.name, rank=rank)}: the bytes read "
                                   f"are not those the rank published (checksum {got}, the rank's {t.checksum}); "
                                   "nothing was committed", reason="checksum")
                if t.elements == (0, t.numel):
                    whole[t.name] = got
        return whole, landed[0]

    def _manifest(self, plan: CopyPlan, data: memoryview, whole: dict[str, str]) -> Manifest:
        """The version's manifest: each tensor's checksum (of its bytes whole: computed here for a tensor
        that several ranks hold parts of)."""
        first = self.ranks[min(self.ranks)]
        spec = first.spec
        tensors = []
        for s in sorted(plan.slots.values(), key=lambda s: s.offset):
            value = whole.get(s.name) or checksum(data[s.offset : s.offset + s.nbytes])
            tensors.append(ServedTensor(s.name, s.shape, s.dtype, s.offset, s.nbytes, value))
        scaled = any(len(served) > 1 for served in rounding.served_masters(plan.slots).values())
        return Manifest(model=self.model, version=self.step, format=spec.format, rounding=spec.rounding,
                        seed=spec.seed, committed_unix=time.time(), data_bytes=plan.data_bytes,
                        master_digest=first.master_digest, tensors=tuple(tensors),
                        scaling=spec.scaling if scaled else "", aliases=first.aliases)


class Copies:
    """The server's publishes in progress: the ranks of each (model, step) joining, then its copy."""

    def __init__(self, settings: Settings, metrics: Metrics, *, committer: Committer, index: VersionIndex,
                 pool: BufferPool, budget: StagingBudget, lender: Callable[[], Lender]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.committer = committer
        self.index = index
        self.pool = pool
        self.budget = budget  # the pushes' staging budget: a publish stages its copy within it too
        self.lender = lender  # the server's NIXL agent (FAILED_PRECONDITION without --nixl)
        self.joining: dict[tuple[str, int], Copying] = {}

    async def run(self, p: RankPublish) -> Committed:
        """One rank's publish: its answer once the version commits (every rank's the same)."""
        self.metrics.publishes_in_flight.inc()
        try:
            self.lender()
            await in_thread(len(p.tensors) >= BIG_MANIFEST, check_rank, p, self.settings)
            self._check(p)
            key = (p.model, p.step)
            copying = self.joining.get(key)
            if copying is None:
                copying = self.joining[key] = Copying(self, p)
            copying.join(p)
            version, created = await copying.wait(p.rank)
            if p.rank == 0:
                m = version.manifest
                log.info("committed model=%s version=%d tensors=%d bytes=%d ranks=%d (published)", m.model, m.version,
                         len(m.tensors), m.data_bytes, p.world_size)
            return version, created
        finally:
            self.metrics.publishes_in_flight.dec()

    def forget(self, copying: Copying) -> None:
        """A failed or committed publish: a retry of its step forms a new one."""
        if self.joining.get((copying.model, copying.step)) is copying:
            del self.joining[(copying.model, copying.step)]

    def _check(self, p: RankPublish) -> None:
        """Refuse a request this server does not take (its checks of its own passed)."""
        s, where = self.settings, subject(p.model, step=p.step)
        if s.relay_from:
            raise FailedPrecondition(f"{where}: this server relays {s.relay_from}; publish there", reason="relay")
        if s.redis_url:
            raise FailedPrecondition(f"{where}: this server is a replica sharing a registry (--redis-url): a publish "
                                     "goes to a server of its own (push to a deployment of replicas)",
                                     reason="invalid_header")
        latest = self.index.latest(p.model)
        if latest is not None and p.step <= latest:
            raise not_above(p.model, p.step, latest)
        if latest is not None and self.index.get(p.model, latest).manifest.adapter is not None:
            raise FailedPrecondition(f"{where}: the model's versions are a LoRA adapter (latest: version {latest}); "
                                     "a publish is of a whole model", reason="invalid_header")
        held = set(self.index.models()) | {m for m, _ in self.joining}
        if p.model not in held and len(held) >= s.max_models:
            raise ResourceExhausted(f"{where}: this server holds or is receiving {len(held)} models, the most it takes "
                                    f"(--max-models {s.max_models})", reason="too_many")
