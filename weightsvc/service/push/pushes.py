"""A push, from its first header to its answer: one owner decides its fate.

Each learner rank opens its own Push stream and declares, in its header, its shards: the tensors it
holds, whole or a flat element range of each. The ranks of one (model, step) join one `Push`: once
every header is in, their shards are merged and checked (shards.py), one staging session
(staging.py) receives all of their chunks, and the version commits when the last rank commits.
Whatever goes wrong with any rank — a refused chunk, a stream that breaks, a timeout, an exception
nobody expected — fails the push for every rank at once with an error naming it, and the last rank
to leave releases the staging memory. Nothing is visible unless the commit completes. A push with
world_size 1 is a push of one rank.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from weightsvc._aio import BIG_MANIFEST, in_thread, let_go, no_full_collections
from weightsvc.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    TooManyRequests,
    WeightsvcError,
    subject,
)
from weightsvc.memory import trim_heap
from weightsvc.protocol.adapter import Adapter
from weightsvc.protocol.manifest import TensorSpec
from weightsvc.service.push.budget import StagingBudget
from weightsvc.service.push.context import PushContext
from weightsvc.service.push.messages import Committed, PushCommit, PushHeader, PushMessage
from weightsvc.service.push.shards import merge_shards
from weightsvc.service.push.staging import PushSession, open_session
from weightsvc.service.push.validate import missing_ranks, validate_header

log = logging.getLogger("weightsvc.push")

FAIR_TURN_S = 0.01  # the longest a push stream holds the event loop before it gives way
TRIM_AFTER_S = 1.0  # after a push, once the transport has let go of its messages, the heap is trimmed


class Push:
    """The ranks pushing one (model, step), and the one owner of that push's fate.

    Ranks join with their headers; the last to join opens the staging session; each rank's stream
    feeds its own chunks; the last rank to commit starts the commit for all, and every rank answers
    with its outcome. `fail` is the only way a push fails, and it fails every rank."""

    def __init__(self, pushes: Pushes, header: PushHeader) -> None:
        self.pushes = pushes
        self.model, self.step, self.world_size = header.model, header.step, header.world_size
        self.where = subject(header.model, step=header.step)
        self.join_timeout = pushes.context.settings.push_rank_timeout_s
        self.deadline = time.monotonic() + self.join_timeout
        self.shards: dict[int, tuple[TensorSpec, ...]] = {}  # each rank's, from its header
        self.format = self.rounding = ""
        self.aliases: tuple[tuple[str, str], ...] = ()
        self.adapter: Adapter | None = None
        self.owners: tuple[tuple[str, ...], int] = ((), 1)
        loop = asyncio.get_running_loop()
        self.joined: asyncio.Future[None] = loop.create_future()
        self.session: asyncio.Future[PushSession] = loop.create_future()
        self.result: asyncio.Future[Committed] = loop.create_future()  # what every rank answers
        self.committed: set[int] = set()
        self.commit_task: asyncio.Future[Committed] | None = None  # started by the last rank
        self.failure: WeightsvcError | None = None
        self.attached = 0  # rank streams not yet ended; the last one releases the session
        self._opening: asyncio.Future[None] | None = None

    def join(self, header: PushHeader) -> None:
        """Add a rank's header; the last one missing opens the staging session."""
        rank = header.rank
        where = f"{self.where} rank {rank}"
        if header.world_size != self.world_size:
            raise InvalidArgument(
                f"{where}: world_size {header.world_size}, but the push in progress has world_size "
                f"{self.world_size}",
                reason="invalid_header",
            )
        if rank in self.shards:
            raise InvalidArgument(f"{where}: this rank is already pushing", reason="invalid_header")
        if self.shards and (header.format, header.rounding) != (self.format, self.rounding):
            raise InvalidArgument(
                f"{where}: format {header.format!r} rounding {header.rounding!r}, but the other ranks asked for "
                f"format {self.format!r} rounding {self.rounding!r}",
                reason="invalid_header",
            )
        if self.shards and header.adapter != self.adapter:
            raise InvalidArgument(f"{where}: adapter {header.adapter}, but the other ranks declared {self.adapter}",
                                  reason="invalid_header")
        if self.shards and header.aliases != self.aliases:
            raise InvalidArgument(
                f"{where}: aliases {dict(header.aliases)}, but the other ranks declared {dict(self.aliases)}",
                reason="invalid_header",
            )
        if self.shards and (header.owners, header.replication) != self.owners:
            raise InvalidArgument(
                f"{where}: owners {list(header.owners)} replication {header.replication}, but the other ranks "
                f"declared owners {list(self.owners[0])} replication {self.owners[1]}",
                reason="invalid_header",
            )
        self.format, self.rounding, self.aliases = header.format, header.rounding, header.aliases
        self.adapter = header.adapter
        self.owners = (header.owners, header.replication)
        self.shards[rank] = header.tensors
        self.attached += 1
        if len(self.shards) == self.world_size:
            self.joined.set_result(None)
            self._opening = asyncio.ensure_future(self._open(header))

    async def run(self, rank: int, messages: AsyncIterator[PushMessage]) -> Committed:
        """Feed one rank's stream into the push and answer with the push's outcome. Any exception
        fails every rank; the last rank to leave releases the staging memory."""
        settings = self.pushes.context.settings
        try:
            session = await self._wait_session()
            turn = time.monotonic() + FAIR_TURN_S
            # A stream that trickles would hold its staging forever: its bytes must come at a rate.
            # (Twice the idle timeout on top: one that stops altogether is told it stalled.)
            big = len(session.shards[rank]) >= BIG_MANIFEST  # (the rank's shards are walked: off the loop)
            rank_bytes = await in_thread(big, session.rank_bytes, rank)
            allowed = 2 * settings.push_idle_timeout_s + rank_bytes / settings.push_min_bytes_per_s
            deadline = (time.monotonic() + allowed, f"{session.where(rank)}: push too slow: not done "
                        f"{allowed:.0f} s after its staging opened (its {rank_bytes} bytes at --push-min-bytes-per-s "
                        f"{settings.push_min_bytes_per_s:.0f}, plus twice --push-idle-timeout-s)")
            while True:
                msg = await next_message(messages, settings.push_idle_timeout_s, deadline)
                if time.monotonic() > turn:
                    # Messages already received are handed over without a pause, so a stream of many
                    # small ones would keep the loop from every other request: give way now and then.
                    await asyncio.sleep(0)
                    turn = time.monotonic() + FAIR_TURN_S
                if self.failure is not None:  # another rank failed: this one stops at its next message
                    raise self.failure
                if isinstance(msg, list):
                    await session.add_chunks(rank, msg)
                elif isinstance(msg, PushCommit):
                    await in_thread(big, session.check_rank_complete, rank)
                    return await self._commit(rank, session)
                elif msg is None:
                    raise Aborted(f"{session.where(rank)}: the stream ended without a commit", reason="aborted")
                else:
                    raise InvalidArgument(f"{session.where(rank)}: a second header", reason="invalid_header")
        except WeightsvcError as e:
            self.fail(e, rank)
            raise
        except asyncio.CancelledError:
            self.fail(Aborted("the stream was cancelled", reason="aborted"), rank)
            opened = self.opened
            if opened is not None and opened.part_of is not None:  # its replica part, if waiting, is taken back
                opened.part_of.abandoned.set()
            raise
        except Exception as e:
            error = self._unexpected(e, f"rank {rank}'s stream" if self.world_size > 1 else "the push")
            self.fail(error, rank)
            raise error from e
        finally:
            self.attached -= 1
            if self.attached == 0:
                await self.pushes.retire(self)

    def fail(self, error: WeightsvcError, rank: int | None = None) -> None:
        """Fail every rank: with `error` itself when it concerns the push, else naming the rank.

        Ranks waiting on the push get the error at once; ranks still streaming get it at their next
        message (their handlers are not cancelled: a gRPC handler cancelled mid-read may never answer)."""
        if self.failure is not None or self.commit_task is not None:
            return  # the first failure is the one reported; a commit in progress decides for itself
        if rank is not None and self.world_size > 1:
            error = Aborted(f"{self.where}: rank {rank} of {self.world_size} failed, so the push is aborted: {error}",
                            reason="aborted")
        self.failure = error
        for future in (self.joined, self.session, self.result):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a push that fails before anyone waits is not an error
        self.pushes.forget(self)

    @property
    def opened(self) -> PushSession | None:
        """The staging session, once opened (None before, or if opening it failed)."""
        return self.session.result() if self.session.done() and not self.session.exception() else None

    def _unexpected(self, e: BaseException, during: str) -> WeightsvcError:
        """A clear error for an exception that is not a refusal: logged with its traceback, reported
        to every rank by name instead of leaving them waiting."""
        log.error("%s: %s failed unexpectedly", self.where, during, exc_info=e)
        if isinstance(e, MemoryError | OSError):
            return ResourceExhausted(f"{self.where}: {during} failed: {type(e).__name__}: {e}; nothing was "
                                     "committed, retry later", reason="internal")
        return Internal(f"{self.where}: {during} failed: {type(e).__name__}: {e}; nothing was committed",
                        reason="internal")

    async def _open(self, header: PushHeader) -> None:
        """Merge the ranks' shards and open the shared staging session; fails the push on any error."""
        pushes = self.pushes
        try:
            count = sum(len(tensors) for tensors in self.shards.values())
            whole = await in_thread(count >= BIG_MANIFEST, self._whole, header)
            needed = await in_thread(count >= BIG_MANIFEST, pushes.budget.needed, whole)
            reserved = pushes.budget.reserve(self.where, needed)
            try:
                session = await open_session(pushes.context, whole, self.shards)
            except BaseException:
                pushes.budget.give_back(reserved)
                raise
            session.reserved = reserved
        except WeightsvcError as e:
            self.fail(e)
            return
        except asyncio.CancelledError:
            self.fail(Aborted(f"{self.where}: the server stopped while staging the push", reason="aborted"))
            raise
        except Exception as e:
            self.fail(self._unexpected(e, "opening its staging session"))
            return
        if self.failure is not None:  # a rank failed while the buffers were being mapped
            await pushes.release(session, self)
            return
        pushes.track(session)
        self.session.set_result(session)

    def _whole(self, header: PushHeader) -> PushHeader:
        """The header of the whole push, from every rank's (checked; linear in the tensors)."""
        whole = dataclasses.replace(header, tensors=merge_shards(self.where, self.shards), rank=0)
        validate_header(whole, self.pushes.context.settings)
        return whole

    async def _wait_session(self) -> PushSession:
        """The shared session, once every rank has joined; fails the push at the join deadline."""
        if not self.joined.done():
            try:
                async with asyncio.timeout(self.deadline - time.monotonic()):
                    await asyncio.shield(self.joined)
            except TimeoutError:
                shown = missing_ranks(self.world_size, self.shards)
                self.fail(DeadlineExceeded(
                    f"{self.where}: rank(s) {shown} of world_size {self.world_size} did not join within "
                    f"{self.join_timeout:g} s (--push-rank-timeout-s); nothing was committed",
                    reason="aborted",
                ))
                assert self.failure is not None
                raise self.failure from None
        return await asyncio.shield(self.session)

    async def _commit(self, rank: int, session: PushSession) -> Committed:
        """This rank has pushed all its shards; the last rank to get here commits for all."""
        if self.failure is not None:
            raise self.failure
        self.committed.add(rank)
        if len(self.committed) == self.world_size:
            # A task of its own: it runs to the end even if the stream that started it is cancelled.
            self.commit_task = asyncio.ensure_future(session.commit())
            self.commit_task.add_done_callback(self._answer)
        return await asyncio.shield(self.result)

    def _answer(self, task: asyncio.Future[Committed]) -> None:
        """The commit is done: every rank answers with its outcome."""
        if self.result.done():
            return
        if task.cancelled():
            self.result.cancel()
        elif (error := task.exception()) is not None:
            if not isinstance(error, WeightsvcError):
                error = self._unexpected(error, "the commit")
            self.result.set_exception(error)
            self.result.exception()  # retrieved: the ranks may all be gone
        else:
            self.result.set_result(task.result())


class Pushes:
    """The server's pushes in progress: the limits on streams and staging memory, the pushes whose
    ranks are still joining, and the staging sessions open."""

    def __init__(self, context: PushContext) -> None:
        self.context = context
        self.settings = context.settings
        self.metrics = context.metrics
        self.budget = StagingBudget(context.settings, context.pool, in_memory=context.files is None)
        self.streams = 0  # push streams open (each rank's counts), against --max-pushes
        self.sessions: set[PushSession] = set()
        self.joining: dict[tuple[str, int], Push] = {}  # multi-rank pushes whose ranks are joining
        self._releasing: set[asyncio.Future[None]] = set()
        self.pushing: collections.Counter[str] = collections.Counter()  # models with push streams open
        self._trim: asyncio.TimerHandle | None = None

    async def run(self, messages: AsyncIterator[PushMessage]) -> Committed:
        """Run one push stream: header, chunks, commit. Nothing is visible unless it commits.

        The stream of one rank of a multi-rank push returns when the whole version commits."""
        settings = self.settings
        big = False  # a push of many tensors (known from its header)
        self.metrics.pushes_in_flight.inc()
        self.streams += 1
        try:
            if self.streams > settings.max_pushes:
                raise TooManyRequests(
                    f"{self.streams - 1} push streams in progress, the most this server takes "
                    f"(--max-pushes {settings.max_pushes}); retry later",
                    reason="too_many",
                )
            header = await next_message(messages, settings.push_idle_timeout_s)
            if not isinstance(header, PushHeader):
                raise InvalidArgument("a push must start with its header", reason="invalid_header")
            big = len(header.tensors) >= BIG_MANIFEST
            with no_full_collections(big):
                await in_thread(big, validate_header, header, settings)
                if header.owners:
                    await self.context.parts.settled(header.model, header.step, header.owners)
                self._check(header)
                self.pushing[header.model] += 1
                try:
                    push = self._join(header)
                    version, created = await push.run(header.rank, messages)
                finally:
                    self.pushing[header.model] -= 1
                    if not self.pushing[header.model]:
                        del self.pushing[header.model]
                    if big:  # (its specs are freed in the reaper once the push lets go of them too)
                        let_go(header.tensors)
            if header.rank == 0:
                log.info("%s model=%s version=%d tensors=%d bytes=%d ranks=%d",
                         "committed" if created else "idempotent push of", header.model, header.step,
                         len(version.manifest.tensors), version.manifest.data_bytes, header.world_size)
            return version, created
        except WeightsvcError as e:
            self.metrics.pushes_rejected.labels(e.reason).inc()
            raise
        except asyncio.CancelledError:
            self.metrics.pushes_rejected.labels("aborted").inc()
            raise
        finally:
            self.metrics.pushes_in_flight.dec()
            self.streams -= 1
            self._trim_heap_soon()

    def _trim_heap_soon(self) -> None:
        """A push is over, committed or not: give the heap's free pages back to the system (a big
        push's header and plan objects, every push's received messages), in a worker thread, once."""
        if self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(TRIM_AFTER_S, self._trim_heap)

    def _trim_heap(self) -> None:
        self._trim = None
        asyncio.get_running_loop().run_in_executor(None, trim_heap)

    def _check(self, header: PushHeader) -> None:
        """Refuse a header (already validated) before it joins anything."""
        context = self.context
        if self.settings.relay_from:
            raise FailedPrecondition(
                f"{subject(header.model, step=header.step)}: this server relays {self.settings.relay_from}; "
                "push there",
                reason="relay",
            )
        replica_id = context.parts.replica_id
        if header.owners and replica_id not in header.owners:
            raise FailedPrecondition(
                f"{subject(header.model, step=header.step)}: this server is replica {replica_id!r}, "
                f"not one of the owners {list(header.owners)}; push each part to its owner (GetTopology)",
                reason="invalid_header",
            )
        if self.settings.redis_url:
            holders = header.replication if header.owners else 1
            context.parts.check_holders(header.model, header.step, holders, self.settings.replication)
        context.committer.check_step(header.model, header.step)
        _check_kind(context, header)
        held = set(context.index.models())
        if header.model not in held and header.model not in self.pushing:
            others = len(held | set(self.pushing))
            if others >= self.settings.max_models:
                raise ResourceExhausted(
                    f"{subject(header.model, step=header.step)}: this server holds or is receiving {others} models, "
                    f"the most it takes (--max-models {self.settings.max_models}); push to one of them, or raise "
                    "the limit",
                    reason="too_many",
                )

    def _join(self, header: PushHeader) -> Push:
        """The push this rank's stream belongs to (a new one for world_size 1)."""
        key = (header.model, header.step)
        push = self.joining.get(key) if header.world_size > 1 else None
        if push is None:
            push = Push(self, header)
            if header.world_size > 1:
                self.joining[key] = push
        push.join(header)
        self.context.changed()
        return push

    def forget(self, push: Push) -> None:
        """A failed or committing push: a retry of its step forms a new one."""
        if self.joining.get((push.model, push.step)) is push:
            del self.joining[(push.model, push.step)]

    def track(self, session: PushSession) -> None:
        """A push opened its staging session."""
        self.sessions.add(session)
        self.context.changed()

    async def retire(self, push: Push) -> None:
        """The last rank of `push` has left: release its staging memory, whatever happened."""
        self.forget(push)
        session = push.opened
        if session is None:
            return  # never opened, or `_open` releases it itself
        # A cancelled handler may be cancelled again while it cleans up: release in a task of its own.
        release = asyncio.ensure_future(self.release(session, push))
        self._releasing.add(release)
        release.add_done_callback(self._releasing.discard)
        await asyncio.shield(release)

    async def release(self, session: PushSession, push: Push) -> None:
        if push.commit_task is not None:  # the version may be committing from this very buffer
            await asyncio.wait([push.commit_task])
        await session.close()
        self.budget.give_back(session.reserved)
        session.reserved = 0
        self.sessions.discard(session)
        self.context.changed()


def _check_kind(context: PushContext, header: PushHeader) -> None:
    """A model's versions are all of a LoRA adapter, or all whole: its latest version says which."""
    latest = context.index.latest(header.model)
    if latest is None:
        return
    held, pushed = context.index.get(header.model, latest).manifest.adapter, header.adapter
    where = subject(header.model, step=header.step)
    if held is not None and pushed is None:
        raise FailedPrecondition(
            f"{where}: the model's versions are a LoRA adapter of base {held.base_model!r} (latest: version {latest}), "
            "and this push declares no adapter: push the adapter's tensors with its config, or push to another model",
            reason="invalid_header")
    if held is None and pushed is not None:
        raise FailedPrecondition(
            f"{where}: the model's versions are whole (latest: version {latest}), and this push declares an adapter "
            f"of base {pushed.base_model!r}: push the adapter to a model of its own", reason="invalid_header")


async def next_message(messages: AsyncIterator[PushMessage], idle: float,
                       deadline: tuple[float, str] | None = None) -> PushMessage | None:
    """The stream's next message; None at its end; DeadlineExceeded after `idle` seconds of nothing,
    or at `deadline` (monotonic time, and what to say)."""
    wait = idle if deadline is None else min(idle, deadline[0] - time.monotonic())
    try:
        async with asyncio.timeout(max(wait, 0)):
            return await anext(messages)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        if wait < idle and deadline is not None:
            raise DeadlineExceeded(deadline[1], reason="aborted") from None
        raise DeadlineExceeded(f"push stalled: nothing received for {idle:g} s", reason="aborted") from None
