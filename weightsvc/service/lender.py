"""`serve --nixl`: committed versions lent to readers over NIXL, the one owner of what is lent.

A reader leases (model, version): the lease is an open pull (`Pulls.open`, transport "nixl"), so the
version is held against retention and eviction exactly as a streamed pull holds it, and its bytes are
named by the same seam (`Pull.pieces`: views of the version's buffer or of its file's mapping). The
version's memory (its data section, or this replica's part of it) is registered with this server's
one NIXL agent while some lease holds it, and deregistered by the last lease to end, before the pull
lets go of the buffer: memory is never lent after it may be recycled. Registering at the first lease
rather than at commit keeps the agent's metadata to what is lent now (a reader adds all of it).

A reader that holds an earlier version may lease the delta encoding against it (`Pulls.delta`: encoded
once per pair of versions, as a delta pull over TCP sends it), registered as the version's memory is,
while some lease holds it; the pull keeps the encoding alive. When there is no delta (not smaller, a
base no longer retained), the version itself is lent.

A lease names the other servers that lend the same versions (`--nixl-sources`, and a relay's upstream):
a reader whose READ fails moves to them.

A lease ends when its reader releases it, or at its deadline (a reader that died, or one slower than
its lease): a release after that is DEADLINE_EXCEEDED, and the reader discards what it read.

The same agent READs what learner ranks publish (`read`, for `service/copies`): into a buffer of this
server's, registered for the READ alone (it is lent, if ever, once committed, as any version is).

Loop-owned: every method runs on the service's event loop (registration runs in a thread), but `read`,
which blocks and runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from weightsvc.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotFound,
    TooManyRequests,
    Unavailable,
    subject,
)
from weightsvc.metrics import Metrics
from weightsvc.protocol.fabric import Lease, MemoryRange, Piece, SharedAgent, new_agent, read_pieces
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.selection import Select
from weightsvc.service.pull import Pull
from weightsvc.service.record import Version
from weightsvc.settings import Settings

log = logging.getLogger("weightsvc.nixl")

TRANSPORT = "nixl"  # the pulls a lease holds, in weightsvc_pulls_in_flight
REMEMBER_ENDED = 4096  # leases that expired, remembered so that their late release says so


def address(view: memoryview) -> int:
    """Where a view of memory starts (read-only views too: a version's file is mapped read-only)."""
    import numpy as np

    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


Memory = tuple[int, int]  # (address, bytes) of a lent buffer: a version's data section, or a delta encoding


@dataclass(eq=False)
class _Registration:
    """A buffer as registered with the agent, and how many leases hold it."""

    descs: object  # the agent's registration list, for deregister_memory
    nbytes: int
    leases: int = 0


@dataclass(eq=False)
class _Lent:
    pull: Pull
    nbytes: int
    memory: Memory  # what the lease holds registered
    lease: Lease | None = None  # as answered
    timer: asyncio.TimerHandle | None = None


class Lender:
    """This server's NIXL agent and the leases on its versions."""

    def __init__(self, settings: Settings, metrics: Metrics,
                 open_pull: Callable[[str, int | None, Select | None, int | None], Awaitable[Pull]]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.open_pull = open_pull
        self.name = f"weightsvc-{os.getpid()}-{secrets.token_hex(4)}"
        # (UNAVAILABLE without the [nixl] extra: serve refuses to start.) Leases register memory in worker
        # threads, and publishes READ with it in others: each call holds the agent's lock.
        self.agent = SharedAgent(new_agent(self.name))
        self._leases: dict[str, _Lent] = {}
        self._expired: collections.OrderedDict[str, str] = collections.OrderedDict()  # lease -> what it was of
        self._registered: dict[Memory, _Registration] = {}
        self._registering: dict[Memory, asyncio.Future[None]] = {}
        self.sources = lent_sources(settings)
        self._metadata: bytes | None = None  # the agent's, since the last change of what is registered

    def __len__(self) -> int:
        return len(self._leases)

    async def lease(self, model: str, version: int | None, select: Select | None, lease_s: float,
                    base: int | None = None) -> Lease:
        """Lend `version` of `model` (None: the latest), its tensors or the selection `select`, for
        `lease_s` seconds (at most --nixl-max-lease-s); with `base` (a version the reader holds), the
        delta encoding against it when there is one."""
        if not 0 < lease_s < float("inf"):
            raise InvalidArgument(f"{subject(model, version)}: a lease of {lease_s} s: ask for a number of seconds "
                                  "above 0")
        if len(self._leases) >= self.settings.max_leases:
            self.metrics.nixl_failures.labels("too_many").inc()
            raise TooManyRequests(f"{len(self._leases)} NIXL leases held, the most this server lends at once "
                                  f"(--max-leases {self.settings.max_leases}); retry later", reason="too_many")
        pull = await self.open_pull(model, version, select, base)
        try:
            m = pull.manifest
            if pull.base is not None:  # the delta encoding, one range
                ranges: dict[str, list[MemoryRange]] = {}
                delta = [MemoryRange(address(pull.body), len(pull.body), 0)] if len(pull.body) else []
                memory = (address(pull.body), len(pull.body))
            else:
                ranges = await asyncio.to_thread(lent_ranges, pull.version, m)  # (100,000 tensors: 0.2 s)
                delta = []
                memory = (address(pull.version.data), len(pull.version.data))
            await self._register(memory, m)
        except BaseException:
            pull.close()
            raise
        lease_id = secrets.token_urlsafe(12)
        lease_s = min(lease_s, self.settings.nixl_max_lease_s)
        lent_bytes = len(pull.body) if pull.base is not None else sum(t.nbytes for t in m.tensors)
        held = _Lent(pull, lent_bytes, memory)
        held.timer = asyncio.get_running_loop().call_later(lease_s, self._expire, lease_id)
        self._leases[lease_id] = held
        self.metrics.nixl_leases.set(len(self._leases))
        if self._metadata is None:
            self._metadata = self.agent.get_agent_metadata()
        held.lease = Lease(lease_id, m, self._metadata, "DRAM", lease_s, ranges, base=pull.base, delta=delta,
                           sources=self.sources)
        return held.lease

    def lent(self, lease_id: str) -> Lease:
        """The lease `lease_id` as it was answered, while it is held (NOT_FOUND after)."""
        held = self._leases.get(lease_id)
        if held is None or held.lease is None:
            raise NotFound("no NIXL lease of that id is held here (never lent, expired, or already released)",
                           reason="unknown_lease")
        return held.lease

    def release(self, lease_id: str) -> None:
        """The reader is done: its lease ends, and what it read counts. DEADLINE_EXCEEDED when the lease
        expired first (the reader must not use what it read), NOT_FOUND for a lease this server never lent."""
        held = self._leases.pop(lease_id, None)
        if held is None:
            what = self._expired.pop(lease_id, None)
            if what is not None:
                raise DeadlineExceeded(f"{what}: the NIXL lease expired before its reader was done; what it read is "
                                       "not vouched for: read again under a new lease", reason="expired")
            self.metrics.nixl_failures.labels("unknown_lease").inc()
            raise NotFound("no NIXL lease of that id is held here (never lent, or already released)",
                           reason="unknown_lease")
        model = held.pull.manifest.model
        self.metrics.nixl_read_bytes.labels(model).inc(held.nbytes)
        self.metrics.nixl_reads.labels(model).inc()
        self._end(held)

    def read(self, metadata: bytes, remote_memory: str, into: memoryview, pieces: list[Piece], *, deadline: float,
             where: str, source: str, done: Callable[[Piece], None]) -> None:
        """READ `pieces` (their local addresses within `into`, a writable buffer of this server's) from
        the agent of `metadata` (`source`, e.g. a learner rank, as messages name it); `done` is called
        with each piece once its bytes are in. Blocking: run it in a worker thread. UNAVAILABLE when the
        agent cannot be reached or goes away; DEADLINE_EXCEEDED past `deadline` (monotonic)."""
        try:
            peer: str = self.agent.add_remote_agent(metadata)
        except Exception as e:
            raise Unavailable(f"{where}: the NIXL agent of {source} cannot be added: {type(e).__name__}: {e}") from None
        try:
            try:
                registered = self.agent.register_memory([(address(into), len(into), 0, "")], "DRAM")
            except Exception as e:
                self.metrics.nixl_failures.labels("register").inc()
                raise Internal(f"{where}: the buffer to READ into could not be registered with NIXL: "
                               f"{type(e).__name__}: {e}", reason="register") from None
            try:
                read_pieces(self.agent, pieces, peer, "DRAM", remote_memory, deadline=deadline, where=where,
                            source=source, late=f"the NIXL READ from {source} did not end in time", done=done)
            finally:
                self.agent.deregister_memory(registered)
        finally:
            with contextlib.suppress(Exception):  # (an agent that went away may be gone already)
                self.agent.remove_remote_agent(peer)

    def close(self) -> None:
        """The server stops: every lease ends (their readers' releases answer NOT_FOUND)."""
        for held in list(self._leases.values()):
            self._end(held)
        self._leases.clear()
        self.metrics.nixl_leases.set(0)

    # ---- internals ---------------------------------------------------------------------------

    def _expire(self, lease_id: str) -> None:
        held = self._leases.pop(lease_id, None)
        if held is None:
            return
        m = held.pull.manifest
        what = subject(m.model, m.version)
        log.warning("%s: a NIXL lease expired before its reader was done (it died, or reads slower than its lease)",
                    what)
        self.metrics.nixl_failures.labels("expired").inc()
        self._expired[lease_id] = what
        while len(self._expired) > REMEMBER_ENDED:
            self._expired.popitem(last=False)
        self._end(held)

    def _end(self, held: _Lent) -> None:
        """A lease ends: the memory it held is deregistered by its last lease, before the pull lets go
        of the version (after which retention may recycle its buffer or unmap its file)."""
        if held.timer is not None:
            held.timer.cancel()
        reg = self._registered.get(held.memory)
        if reg is not None:
            reg.leases -= 1
            if reg.leases == 0:
                del self._registered[held.memory]
                if reg.descs is not None:
                    self.agent.deregister_memory(reg.descs)
                self._metadata = None
                self.metrics.nixl_registered_bytes.dec(reg.nbytes)
        held.pull.close()
        self.metrics.nixl_leases.set(len(self._leases))

    async def _register(self, memory: Memory, m: Manifest) -> None:
        """Count one more lease on the registered `memory` (of the version `m`), registering it first if
        none holds it (the first lease registers; those that come meanwhile wait for it, and fail with it)."""
        while (reg := self._registered.get(memory)) is None:
            pending = self._registering.get(memory)
            if pending is not None:
                await asyncio.shield(pending)
                continue  # (registered now, unless its lease already ended: then again)
            pending = asyncio.get_running_loop().create_future()
            self._registering[memory] = pending
            try:
                addr, nbytes = memory
                descs = None if nbytes == 0 else await asyncio.to_thread(
                    self.agent.register_memory, [(addr, nbytes, 0, "")], "DRAM")
            except Exception as e:
                self.metrics.nixl_failures.labels("register").inc()
                failed = Internal(f"{subject(m.model, m.version)}: its memory could not be registered with NIXL: "
                                  f"{type(e).__name__}: {e}", reason="register")
                pending.set_exception(failed)
                pending.exception()  # (retrieved: the waiters, if any, raise it too)
                raise failed from None
            finally:
                del self._registering[memory]
            reg = self._registered[memory] = _Registration(descs, nbytes)
            self._metadata = None
            self.metrics.nixl_registered_bytes.inc(nbytes)
            pending.set_result(None)
        reg.leases += 1


def lent_ranges(version: Version, m: Manifest) -> dict[str, list[MemoryRange]]:
    """Where each tensor of `m` (the version's, or a selection's: each tensor's slice) lies in the
    version's memory (`Version.ranges`), as addresses. Blocking at many tensors: run it in a thread."""
    at = address(version.data)
    spans = version.spans
    whole = len(spans) == 1 and spans[0].start == 0  # (all of the data section: byte o at data[o])
    if whole and m is version.manifest:
        return {t.name: [MemoryRange(at + t.offset, t.nbytes, 0)] if t.nbytes else [] for t in m.tensors}
    return {t.name: [MemoryRange(at + o, n, 0) for o, n in version.ranges(t.name, t.slice)] for t in m.tensors}


def lent_sources(settings: Settings) -> list[str]:
    """The other servers a lease names as sources of the same versions: --nixl-sources, then a relay's
    upstream (when it lends nothing over NIXL, a reader's lease there says so, and it moves on)."""
    sources = [s.strip() for s in settings.nixl_sources.split(",") if s.strip()]
    upstream = settings.relay_from
    if upstream and not upstream.startswith("s3://") and upstream not in sources:
        sources.append(upstream)
    return sources
