"""Sharded replicas: this replica's part of a version. It is committed to the registry, waits for the
other owners' parts, and is withdrawn if they do not come; once the version commits, the part is
served under the manifest of the whole version.

Loop-owned: every method runs on the service's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from weightsvc.errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Unavailable,
    WeightsvcError,
    subject,
)
from weightsvc.protocol.manifest import Manifest, Part
from weightsvc.protocol.parts import Segment
from weightsvc.protocol.topology import REPLICA_TTL_S
from weightsvc.service.record import Version
from weightsvc.service.replicas.registry import CommitResult, Registry, manifest_from_registry, record_digest

log = logging.getLogger("weightsvc.store")
SETTLE_S = 5.0  # how long a push waits for the part a cancelled push left waiting to be settled
RECORD_AGAIN_S = 1.0  # how often a waiting part checks that the registry still holds it
T = TypeVar("T")


@dataclass
class PartOf:
    """This replica's part of a version of sharded replicas: the owners of all its parts, how long to
    wait for theirs, and an event the push sets when its learner gives up."""

    owners: tuple[str, ...]
    timeout: float
    abandoned: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Waiting:
    """A part of a model that waits for the other owners': its version, its push, and an event set
    once it is settled (committed or withdrawn)."""

    version: int
    part_of: PartOf
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class Parts:
    """This replica's parts, as one of the owners of a model's tensors."""

    def __init__(self, registry: Registry, retain: int) -> None:
        self.replica_id = ""  # this server's id in the topology (set when it registers)
        self._registry = registry
        self._retain = retain
        self._waiting: dict[str, _Waiting] = {}  # model -> its part that waits for the other owners'
        self._lost_at: float | None = None  # (loop time) when the registry was last found to have lost its data
        self.replicas_seen = 0  # how many replicas the topology last held (before the registry lost its data)

    def registry_lost(self) -> None:
        """The registry lost its data: the replicas' registrations with it, for as long as they take to
        register again (`REPLICA_TTL_S`)."""
        self._lost_at = asyncio.get_running_loop().time()

    def recovering(self) -> bool:
        """Whether the registry lost its data so lately that some replicas may not have registered again."""
        return self._lost_at is not None and asyncio.get_running_loop().time() < self._lost_at + REPLICA_TTL_S

    def check_holders(self, model: str, step: int, holders: int, replication: int) -> None:
        """While replicas may still be registering again after the registry lost its data, a push to
        fewer holders of each tensor than `replication` (a learner that saw too few) is UNAVAILABLE,
        unless there were not as many replicas before either."""
        if holders < min(replication, self.replicas_seen) and self.recovering():
            raise Unavailable(
                f"{subject(model, step=step)}: the registry lost its data lately and the replicas are registering "
                f"again; a push to {holders} holder(s) of each tensor, fewer than the {replication} of the deployment, "
                "waits for them: push again in a few seconds", reason="registry")

    async def settled(self, model: str, step: int, owners: tuple[str, ...]) -> None:
        """Wait a little for a part of `model` that waits for the other owners to be settled (committed
        or withdrawn). A push of the same step to other owners is its learner's push made again
        without a replica it could not reach: the waiting part is given up at once."""
        waiting = self._waiting.get(model)
        if waiting is None:
            return
        if waiting.version == step and sorted(waiting.part_of.owners) != sorted(owners):
            waiting.part_of.abandoned.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SETTLE_S):
                await waiting.settled.wait()

    def check_not_waiting(self, model: str, step: int) -> None:
        """One part of a model waits for the other owners at a time: what follows builds on it."""
        waiting = self._waiting.get(model)
        if waiting is not None and waiting.part_of.abandoned.is_set():  # (withdrawn once the registry answers)
            raise Unavailable(
                f"{subject(model, step=step)}: this replica's part of version {waiting.version}, which its learner "
                "abandoned, is still being withdrawn from the registry; push again shortly",
                reason="registry",
            )
        if waiting is not None:
            raise FailedPrecondition(
                f"{subject(model, step=step)}: this replica's part of version {waiting.version} is waiting for the "
                "other owners' parts; push again once it commits or is withdrawn",
                reason="step_not_above_latest",
            )

    def own(self, version: Version) -> Version:
        """`version` as this replica's file holds it: the part alone, marked as this replica's (with
        replication, its groups of tensors are marked already)."""
        m = version.manifest
        if not m.parts:
            m = dataclasses.replace(m, parts=(Part(self.replica_id, 0, m.data_bytes),))
        return dataclasses.replace(version, manifest=m, header=b"")  # its header is made at commit

    async def commit(self, part: Version, part_of: PartOf, text: str | None = None
                     ) -> tuple[CommitResult, Version, str]:
        """Commit this replica's part; wait for the other owners' parts, or withdraw it. Returns the
        registry's decision, the version as served (the whole manifest, this part's bytes; held elsewhere
        when the registry holds this part from an earlier push whose bytes differ from these: another
        rounding, another ef residual) and the registry's record of it (to keep beside the part: `Records`).
        Raises only while the version is not committed: once it is, this replica keeps its part.
        `text`: the part's manifest as JSON, when the caller has made it."""
        m = part.manifest
        where = subject(m.model, m.version)
        if part_of.abandoned.is_set():
            raise Aborted(f"{where}: the learner abandoned the push; nothing was committed", reason="aborted")
        mine = text if text is not None else await asyncio.to_thread(m.json)
        groups = group_digests(m)

        def record() -> Awaitable[CommitResult | None]:
            return self._registry.commit_part(m.model, m.version, self.replica_id, part_of.owners, m.master_digest,
                                              mine, self._retain, groups)

        self._waiting[m.model] = waiting = _Waiting(m.version, part_of)
        try:
            try:
                decided = await record()
            except Unavailable as e:  # recorded or not: the registry's answer to a withdraw settles it
                if await self._withdraw(m.model, m.version, part_of.owners):
                    raise e from None
                decided = CommitResult(created=True)
            if decided is None:
                arrived = await self._other_parts(m.model, m.version, part_of, record)
                if not arrived and await self._withdraw(m.model, m.version, part_of.owners):
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
            if self._waiting.get(m.model) is waiting:
                del self._waiting[m.model]
            waiting.settled.set()
        raw = await _registry_answer(lambda: self._registry.manifest(m.model, m.version), f"reading {where}")
        if raw is None:
            latest = max(await _registry_answer(lambda: self._registry.versions(m.model), f"listing {where}"),
                         default=None)
            if latest is not None and latest > m.version:
                raise FailedPrecondition(f"{where}: committed, and already retired by newer versions", reason="other")
            raise Unavailable(f"{where}: the registry lost the version (its data) as it committed; push again",
                              reason="registry")
        served = await asyncio.to_thread(_served, part, raw)  # parses the whole manifest, makes its header
        if served is None and decided.created:
            raise DataLoss(f"{where}: the registry's manifest does not hold this replica's part")
        if served is None:  # this very part (its masters) committed before, exported then to other bytes
            served = await asyncio.to_thread(Version.elsewhere, manifest_from_registry(raw, where))
        return decided, served, raw

    async def restored(self, part: Version, record: str | None) -> tuple[Version | None, str | None]:
        """A part restored from this replica's file, served under the registry's record of the whole
        version, and that record; (None, None) where the registry decided against it.

        `record`: the registry's record kept beside the part when its version committed. The registry
        that does not know the version lost it (its data): the record gives it back, the same digest
        and manifest as before, unless retention leaves it out. Without a record the version never
        committed as far as this replica knows (written before a crash): the part is withdrawn, and
        goes only if the registry takes it back (it could still complete). A part whose version the
        registry holds with other content goes."""
        m = part.manifest
        raw = await self._registry.manifest(m.model, m.version)
        if raw is None and record is not None:
            try:
                if not await self._registry.restore(m.model, m.version, record_digest(record), record, self._retain):
                    return None, None  # older than what retention keeps
            except AlreadyExists:
                pass  # restored meanwhile with other content: told apart below
            raw = await self._registry.manifest(m.model, m.version)
        if raw is None and not await self._registry.withdraw_part(m.model, m.version, m.parts[0].owner, m.owners):
            raw = await self._registry.manifest(m.model, m.version)  # the last part came in meanwhile
        whole = None if raw is None else await asyncio.to_thread(_served, part, raw)
        return (whole, raw) if whole is not None else (None, None)

    async def _withdraw(self, model: str, version: int, owners: tuple[str, ...]) -> bool:
        """Take this replica's part back: True, or False if the version committed first."""
        return await _registry_answer(lambda: self._registry.withdraw_part(model, version, self.replica_id, owners),
                              f"withdrawing its part of {subject(model, version)}")

    async def _other_parts(self, model: str, version: int, part_of: PartOf,
                           record: Callable[[], Awaitable[CommitResult | None]]) -> bool:
        """Wait until the registry commits `version` (True), or until the timeout or the learner
        abandons the push (False). A registry that lost its data (restarted empty, failed over) lost
        this part too: it is recorded again (`record`), so the version still commits once every
        owner's part is in, or is told that it committed (given back by its holders)."""

        async def committed() -> bool:
            while True:
                try:
                    async for v in self._registry.events(model, version - 1):
                        return v == version  # a later version first: this one can no longer commit
                except Unavailable:
                    await asyncio.sleep(0.5)  # the deadline still holds

        async def recorded() -> bool:
            while True:
                await asyncio.sleep(RECORD_AGAIN_S)
                with contextlib.suppress(Unavailable):
                    if not await self._registry.part_pending(model, version, self.replica_id, part_of.owners):
                        with contextlib.suppress(WeightsvcError):  # (refused: the deadline decides)
                            if await record() is not None:
                                return True

        waiting = [asyncio.ensure_future(committed()), asyncio.ensure_future(recorded()),
                   asyncio.ensure_future(part_of.abandoned.wait())]
        try:
            done, _ = await asyncio.wait(waiting, timeout=part_of.timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiting:
                w.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        return any(w in done and w.result() is True for w in waiting[:2])


def group_digests(m: Manifest) -> dict[str, str]:
    """A replicated part's groups of tensors (by their owners, comma-separated) and a digest of what
    each holds: its tensors' names, places and checksums. The owners of a group must agree on it."""
    out, at = {}, 0
    for group in m.parts:
        if not group.holders:
            continue
        lines = [f"{t.name}:{t.offset - group.offset}:{t.checksum}" for t in m.tensors[at : at + group.tensors]]
        out[",".join(group.holders)] = hashlib.sha1("\n".join(lines).encode()).hexdigest()
        at += group.tensors
    return out


def _served(part: Version, raw: str) -> Version | None:
    """This replica's part (as in its file) served under the registry's manifest `raw` of the whole
    version, or None when that version holds no such part (another owner, size, digest or bytes)."""
    m = part.manifest
    owner = m.parts[0].owner
    whole = manifest_from_registry(raw, subject(m.model, m.version))
    recorded = json.loads(raw).get(owner)
    if not isinstance(recorded, dict) or recorded.get("digest") != m.master_digest:
        return None
    committed = {t.name: t.checksum for t in whole.tensors}
    if any(committed.get(t.name) != t.checksum for t in m.tensors):
        return None  # the same masters, exported to other bytes than those committed
    segments = []
    for mine in m.parts:
        held = next((p for p in whole.parts if p.nbytes == mine.nbytes and
                     (p.holders == mine.holders if mine.holders else p.owner == owner)), None)
        if held is None:
            return None
        segments.append(Segment(held.offset, mine.offset, mine.nbytes))
    return dataclasses.replace(part, manifest=whole, header=whole.safetensors_header(), part=m,
                               segments=tuple(segments))


async def _registry_answer(call: Callable[[], Awaitable[T]], what: str) -> T:
    """The registry's answer, however long it is away: a part's fate must be known before its bytes
    are kept or dropped."""
    while True:
        try:
            return await call()
        except Unavailable as e:
            log.warning("%s: %s; retrying", what, e)
            await asyncio.sleep(1.0)
