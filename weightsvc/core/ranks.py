"""Pushes by several learner ranks: how their parts combine into one version.

Each rank of an FSDP or tensor-parallel learner opens its own Push stream and declares, in its
header, the tensors it holds and for each one the flat element range it pushes. The ranks of one
(model, step) form a `RankGroup`: once every header is in, their parts are merged and checked (each
tensor covered exactly once, shapes agreed), one staging session receives all of their chunks, and
the version commits when the last rank commits. If any rank fails, times out or never arrives, the
group fails as a whole and nothing is visible. A push with world_size 1 is a group of one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from weightsvc.core.manifest import TensorSpec
from weightsvc.errors import Aborted, DeadlineExceeded, InvalidArgument, WeightsvcError

if TYPE_CHECKING:
    from weightsvc.core.service import PushSession
    from weightsvc.core.store import Version

MAX_WORLD_SIZE = 1 << 16
Committed = tuple["Version", bool]  # the committed version, and whether this push created it


def merge_parts(where: str, ranks: Mapping[int, tuple[TensorSpec, ...]]) -> tuple[TensorSpec, ...]:
    """The whole tensors that the ranks' parts make up, in order of first declaration (lowest rank
    first); raises if ranks disagree on a shape or the parts of a tensor leave a gap or overlap."""
    whole: dict[str, TensorSpec] = {}
    pieces: dict[str, list[tuple[int, int, int]]] = {}  # name -> (offset, count, rank)
    for rank in sorted(ranks):
        for spec in ranks[rank]:
            first = whole.setdefault(spec.name, TensorSpec(spec.name, spec.shape, spec.dtype))
            if first.shape != spec.shape:
                owner = pieces[spec.name][0][2]
                raise InvalidArgument(
                    f"{where}: tensor {spec.name!r}: rank {owner} declares shape {list(first.shape)}, "
                    f"rank {rank} declares {list(spec.shape)}",
                    reason="invalid_header",
                )
            pieces.setdefault(spec.name, []).append((*spec.elements, rank))
    for name, parts in pieces.items():
        numel = whole[name].numel
        end, end_rank = 0, None
        for offset, count, rank in sorted(parts):
            if count == 0:
                continue
            if offset < end:
                raise InvalidArgument(
                    f"{where}: tensor {name!r}: the part of rank {rank} (elements [{offset}, {offset + count})) "
                    f"overlaps the part of rank {end_rank}, which ends at element {end}",
                    reason="invalid_header",
                )
            if offset > end:
                break
            end, end_rank = offset + count, rank
        if end != numel:
            missing_end = min([o for o, c, _ in parts if o > end and c] + [numel])
            raise InvalidArgument(
                f"{where}: tensor {name!r} of shape {list(whole[name].shape)}: no rank pushes elements "
                f"[{end}, {missing_end})",
                reason="invalid_header",
            )
    return tuple(whole.values())


class RankGroup:
    """The ranks pushing one (model, step): they meet on their headers, share one staging session,
    and the version commits when the last of them has committed."""

    def __init__(self, model: str, step: int, world_size: int, join_timeout: float) -> None:
        self.model = model
        self.step = step
        self.world_size = world_size
        self.where = f"model {model!r} step {step}"
        self.deadline = time.monotonic() + join_timeout
        self.join_timeout = join_timeout
        self.headers: dict[int, tuple[TensorSpec, ...]] = {}
        self.format = self.rounding = ""
        loop = asyncio.get_running_loop()
        self.joined: asyncio.Future[None] = loop.create_future()
        self.session: asyncio.Future[PushSession] = loop.create_future()
        self.committed: set[int] = set()
        self.commit_task: asyncio.Future[Committed] | None = None  # started by the last rank
        self.result: asyncio.Future[Committed] = loop.create_future()  # what every rank returns
        self.failure: WeightsvcError | None = None
        self.attached = 0  # rank streams not yet ended; the last one releases the session

    def join(self, rank: int, world_size: int, tensors: tuple[TensorSpec, ...], fmt: str, rnd: str) -> bool:
        """Add a rank's header; True when it was the last one missing."""
        where = f"{self.where} rank {rank}"
        if world_size != self.world_size:
            raise InvalidArgument(
                f"{where}: world_size {world_size}, but the push in progress has world_size {self.world_size}",
                reason="invalid_header",
            )
        if rank in self.headers:
            raise InvalidArgument(f"{where}: this rank is already pushing", reason="invalid_header")
        if self.headers and (fmt, rnd) != (self.format, self.rounding):
            raise InvalidArgument(
                f"{where}: format {fmt!r} rounding {rnd!r}, but the other ranks asked for format "
                f"{self.format!r} rounding {self.rounding!r}",
                reason="invalid_header",
            )
        self.format, self.rounding = fmt, rnd
        self.headers[rank] = tensors
        self.attached += 1
        if len(self.headers) < self.world_size:
            return False
        self.joined.set_result(None)
        return True

    async def wait_session(self) -> PushSession:
        """The shared session, once every rank has joined; fails the group at the join deadline."""
        if not self.joined.done():
            try:
                async with asyncio.timeout(self.deadline - time.monotonic()):
                    await asyncio.shield(self.joined)
            except TimeoutError:
                missing = sorted(set(range(self.world_size)) - set(self.headers))
                shown = ", ".join(map(str, missing[:10]))
                shown += f" and {len(missing) - 10} more" if len(missing) > 10 else ""
                error = DeadlineExceeded(
                    f"{self.where}: rank(s) {shown} of world_size {self.world_size} did not join within "
                    f"{self.join_timeout:g} s (--push-rank-timeout-s); nothing was committed",
                    reason="aborted",
                )
                self.fail(error)
                raise error from None
        return await asyncio.shield(self.session)

    @property
    def staged(self) -> PushSession | None:
        """The group's staging session, once opened (None before, or if opening it failed)."""
        return self.session.result() if self.session.done() and not self.session.exception() else None

    def fail(self, error: WeightsvcError, rank: int | None = None) -> None:
        """Fail every rank: with `error` itself when it concerns the group, else naming the rank.

        Ranks waiting on the group get the error at once; ranks still streaming get it at their next
        message (their handlers are not cancelled: a gRPC handler cancelled mid-read may never answer)."""
        if self.failure is not None or self.commit_task is not None:
            return  # the first failure is the one reported; a commit in progress decides for itself
        if rank is not None and self.world_size > 1:
            error = Aborted(f"{self.where}: rank {rank} of {self.world_size} failed, so the push is aborted: {error}",
                            reason="aborted")  # fmt: skip
        self.failure = error
        for future in (self.joined, self.session, self.result):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a group that fails before anyone waits is not an error

    async def commit(self, rank: int, commit: Callable[[], Coroutine[Any, Any, Committed]]) -> Committed:
        """This rank has pushed all its parts; the last rank to get here starts `commit()` for all."""
        if self.failure is not None:
            raise self.failure
        self.committed.add(rank)
        if len(self.committed) == self.world_size:
            # A task of its own: it runs to the end even if the stream that started it is cancelled.
            self.commit_task = asyncio.ensure_future(commit())
            self.commit_task.add_done_callback(self._settle)
        return await asyncio.shield(self.result)

    def _settle(self, task: asyncio.Future[Committed]) -> None:
        if self.result.done():
            return
        if task.cancelled():
            self.result.cancel()
        elif (error := task.exception()) is not None:
            self.result.set_exception(error)
            self.result.exception()  # retrieved: the ranks may all be gone
        else:
            self.result.set_result(task.result())
