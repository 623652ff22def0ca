"""The fabric data plane (NIXL), as client and server share it: a lease on a version, the memory its
tensors lie in, and the one place that loads NIXL (the `[nixl]` extra: absent, nothing else changes).

A reader leases (model, version) for a while: the server answers its NIXL agent's metadata, the
manifest of what the reader asked for (the version's, or a selection's: the same checksums as a pull
of it) and, per tensor, the `MemoryRange`s its bytes lie in (`selection.byte_ranges`: one for a whole
tensor or a range of rows). The reader READs them into its own memory, then releases the lease; a
release after the lease expired is DEADLINE_EXCEEDED, and what was read is not to be used.

The same one-sided READ (`read_pieces`) serves both ends: a reader READs a server's version, and a
`serve --nixl` server READs what learner ranks publish (`protocol.published`).

A reader that holds an earlier version (`base`) may be lent the delta encoding against it instead (the
bytes a delta pull over TCP would carry, encoded once per pair of versions): it READs the encoding and
patches its tensors. A lease also lists the other servers that lend the same version (`sources`): a
reader whose READ fails moves to the next.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from weightsvc._aio import memo
from weightsvc.errors import DataLoss, DeadlineExceeded, InvalidArgument, Unavailable, subject
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.wire import MESSAGE_PIECE_BYTES, manifest_from_proto, manifest_to_proto, piece_starts
from weightsvc.v1 import weightsvc_pb2 as pb

DEFAULT_LEASE_S = 60.0  # a reader's lease unless it asks for another (the server caps it)


class MemoryRange(NamedTuple):
    """Bytes of a source's registered memory: a NIXL descriptor (`device` 0 for host memory)."""

    addr: int
    nbytes: int
    device: int


@dataclass(frozen=True)
class Lease:
    """A reader's lease on a version: what it reads, where it lies, and for how long it is lent."""

    lease_id: str
    manifest: Manifest  # the version's, or the selection's
    agent: bytes  # the source's NIXL agent metadata (it names the agent and its registered memory)
    memory: str  # "DRAM" or "VRAM"
    lease_s: float  # lent for this long from the answer
    ranges: dict[str, list[MemoryRange]]  # per tensor of `manifest`, in its order (none for a delta)
    base: int | None = None  # a delta read: the version the encoding in `delta` applies to
    delta: list[MemoryRange] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # other servers that lend the version, in order

    @property
    def delta_bytes(self) -> int:
        return sum(r.nbytes for r in self.delta)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "manifest": self.manifest.to_dict(),
            "agent": base64.b64encode(self.agent).decode(),
            "memory": self.memory,
            "lease_s": self.lease_s,
            "ranges": {name: [list(r) for r in rs] for name, rs in self.ranges.items()},
            "base": self.base,
            "delta": [list(r) for r in self.delta],
            "sources": self.sources,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> Lease:
        """The lease as a server answered it; DATA_LOSS when it is not one."""
        try:
            return cls(
                lease_id=str(d["lease_id"]),
                manifest=Manifest.from_dict(d["manifest"]),
                agent=base64.b64decode(d["agent"], validate=True),
                memory=str(d["memory"]),
                lease_s=float(d["lease_s"]),
                ranges={str(name): [MemoryRange(*map(int, r)) for r in rs] for name, rs in d["ranges"].items()},
                base=None if d.get("base") is None else int(d["base"]),
                delta=[MemoryRange(*map(int, r)) for r in d.get("delta", ())],
                sources=[str(s) for s in d.get("sources", ())],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DataLoss(f"{where}: the lease answered is not one: {type(e).__name__}: {e}") from None


def _lease_starts(lease: Lease) -> list[int]:
    """Where each piece of a lease's answer over gRPC begins (by tensor): a big manifest, and its
    ranges, go in messages of about MESSAGE_PIECE_BYTES, as GetManifest's."""
    return piece_starts((2 * len(t.name) + len(t.checksum) + 16 * len(t.shape) + 72
                         + 24 * len(lease.ranges.get(t.name, ())) for t in lease.manifest.tensors), MESSAGE_PIECE_BYTES)


def lease_to_proto(lease: Lease, tensors_from: int = 0) -> pb.VersionLease:
    """The lease over gRPC: its tensors from `tensors_from` on, as many as one piece holds (the
    reader asks for the rest by the lease's id)."""
    m = lease.manifest
    starts = memo(lease, "grpc-lease-pieces", _lease_starts)
    if not 0 <= tensors_from <= len(m.tensors):
        raise InvalidArgument(f"the lease of {subject(m.model, m.version)} has {len(m.tensors)} tensors: "
                              f"tensors_from {tensors_from} is out of range")
    i = bisect.bisect_right(starts, tensors_from) - 1
    tensors = m.tensors[tensors_from : starts[i + 1] if i + 1 < len(starts) else len(m.tensors)]
    return pb.VersionLease(
        lease_id=lease.lease_id, manifest=manifest_to_proto(m, tensors), agent=lease.agent, memory=lease.memory,
        lease_s=lease.lease_s,
        tensors=[pb.TensorRanges(tensor=t.name, ranges=[_range_to_proto(r) for r in lease.ranges[t.name]])
                 for t in tensors if t.name in lease.ranges],
        base_version=lease.base, delta=[_range_to_proto(r) for r in lease.delta], sources=lease.sources,
    )


def _range_to_proto(r: MemoryRange) -> pb.MemoryRange:
    return pb.MemoryRange(addr=r.addr, nbytes=r.nbytes, device=r.device)


def lease_from_proto(m: pb.VersionLease, where: str, more: Iterable[pb.VersionLease] = ()) -> Lease:
    """The lease as a server answered it over gRPC, with the pieces that came after its first (`more`)."""
    pieces = [m, *more]
    manifest = manifest_from_proto(m.manifest, (t for piece in pieces[1:] for t in piece.manifest.tensors))
    ranges = {t.tensor: [MemoryRange(r.addr, r.nbytes, r.device) for r in t.ranges]
              for piece in pieces for t in piece.tensors}
    return Lease(m.lease_id, manifest, m.agent, m.memory, m.lease_s, ranges,
                 base=m.base_version if m.HasField("base_version") else None,
                 delta=[MemoryRange(r.addr, r.nbytes, r.device) for r in m.delta], sources=list(m.sources))


def nixl_agent_class() -> Any:
    """NIXL's agent class (`nixl_agent`), from the meta package or the CUDA 12 wheel; UNAVAILABLE,
    saying how to install it, without the `[nixl]` extra."""
    raising = logging.raiseExceptions
    try:
        from nixl._api import nixl_agent
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent
        except ImportError:
            raise Unavailable("NIXL is not installed: pip install 'weightsvc[nixl]'", reason="nixl_off") from None
    # NIXL logs to stdout on a handler of its own (where `serve` prints its ready line) and turns off
    # logging's error reports for the whole process: its records go through ours instead, warnings up.
    logging.raiseExceptions = raising
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    nixl_log.setLevel(logging.WARNING)
    return nixl_agent


PROGRESS_WAIT_US = 100  # the NIXL progress thread's wait between passes: NIXL's Python API sets none


def new_agent(name: str) -> Any:
    """A NIXL agent whose progress thread waits PROGRESS_WAIT_US between passes. NIXL's Python API
    builds its agent's config itself with no wait, and its progress thread then spins: a whole core
    for as long as the process lives (an idle server, every engine worker that ever read), and on a
    small machine READs at half speed, the spinning threads of both ends taking the cores the copy
    needs. The config type is swapped for one that keeps the wait for as long as the agent is built
    (under a lock: nothing else builds one meanwhile); tests/unit/test_fabric.py fails if NIXL stops
    taking it."""
    agent_class = nixl_agent_class()
    api = sys.modules[agent_class.__module__]
    bind: Any = getattr(api, "nixlBind", None)
    config = getattr(bind, "nixlAgentConfig", None)
    if config is None:  # (another NIXL: built as it is)
        return agent_class(name)

    class Paced(config):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, max(value, PROGRESS_WAIT_US) if key == "pthrDelay" else value)

    with _BUILDING:
        bind.nixlAgentConfig = Paced
        try:
            return agent_class(name)
        finally:
            bind.nixlAgentConfig = config


_BUILDING = threading.Lock()


class SharedAgent:
    """A NIXL agent that several threads call: NIXL's Python agent is built without thread sync
    (NIXL_THREAD_SYNC_NONE unless it listens), so each call holds a lock (a call is short: a READ is
    started and then polled, never waited on inside NIXL)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return locked


# ---- one-sided READs, in pieces -------------------------------------------------------------------

PIECE = 64 << 20  # bytes a READ moves at a time: the next piece moves while the last one is hashed
POLL_S = 0.0002  # between looks at a READ in progress (NIXL's Python API has no wait)
RELEASE_TRIES = 5000  # looks (POLL_S apart) at an abandoned READ before its handle is left to the agent
Descriptor = tuple[int, int, int]  # (address, bytes, device) of a NIXL transfer descriptor
log = logging.getLogger("weightsvc.nixl")


class Piece:
    """Up to a piece's bytes of a READ: its descriptors, and the byte spans of the tensors it fills."""

    def __init__(self) -> None:
        self.local: list[Descriptor] = []
        self.remote: list[Descriptor] = []
        self.spans: list[tuple[str, int, int]] = []  # (tensor, start, end) of its bytes, in order
        self.nbytes = 0


def cut_pieces(tensors: Iterable[tuple[str, int, int, Sequence[MemoryRange]]], piece_bytes: int) -> list[Piece]:
    """The READs of each (name, destination address, its device, source ranges), the ranges READ into
    the destination one after another, cut into pieces of at most `piece_bytes`. A span's bytes are
    counted from the destination's start."""
    pieces = [Piece()]
    for name, at, device, ranges in tensors:
        filled = 0
        for r in ranges:
            done = 0
            while done < r.nbytes:
                piece = pieces[-1]
                if piece.nbytes == piece_bytes:
                    piece = Piece()
                    pieces.append(piece)
                n = min(r.nbytes - done, piece_bytes - piece.nbytes)
                piece.local.append((at + filled, n, device))
                piece.remote.append((r.addr + done, n, r.device))
                if piece.spans and piece.spans[-1][0] == name and piece.spans[-1][2] == filled:
                    piece.spans[-1] = (name, piece.spans[-1][1], filled + n)
                else:
                    piece.spans.append((name, filled, filled + n))
                piece.nbytes += n
                done += n
                filled += n
    return [p for p in pieces if p.nbytes]


def read_pieces(agent: Any, pieces: list[Piece], peer: str, local_memory: str, remote_memory: str, *,
                deadline: float, where: str, source: str, late: str, done: Callable[[Piece], None]) -> None:
    """READ the pieces from `peer` (`source`, as messages name it), two in flight: `done` is called
    with each one once its bytes are in. UNAVAILABLE when NIXL cannot reach it or it goes away
    mid-READ; DEADLINE_EXCEEDED, saying `late`, past `deadline` (monotonic)."""
    handles: list[Any] = []

    def call(fn: Callable[[Any], str], handle: Any) -> str:
        try:
            return fn(handle)
        except Exception as e:  # NIXL raises when the source went away mid-READ (NIXL_ERR_REMOTE_DISCONNECT)
            raise Unavailable(f"{where}: the NIXL READ from {source} failed: {type(e).__name__}: {e}") from None

    try:
        for piece in pieces:
            try:
                handles.append(agent.initialize_xfer(
                    "READ", agent.get_xfer_descs(piece.local, local_memory),
                    agent.get_xfer_descs(piece.remote, remote_memory), peer))
            except Exception as e:
                raise Unavailable(f"{where}: NIXL cannot READ from {source}: {type(e).__name__}: {e}") from None
        started = [call(agent.transfer, handles[0])] if handles else []
        for i, piece in enumerate(pieces):
            if i + 1 < len(pieces):
                started.append(call(agent.transfer, handles[i + 1]))
            state = started[i]
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"{where}: {late}", reason="expired")
                time.sleep(POLL_S)
                state = call(agent.check_xfer_state, handles[i])
            if state != "DONE":
                raise Unavailable(f"{where}: the NIXL READ from {source} failed ({state})")
            done(piece)
    finally:
        for handle in handles:
            release_handle(agent, handle)


def release_handle(agent: Any, handle: Any) -> None:
    """A handle given back; one still moving (its READ abandoned) is waited for first, briefly: NIXL
    refuses to release a transfer in progress, and its bytes must not land after the caller moved on."""
    for _ in range(RELEASE_TRIES):
        try:
            agent.release_xfer_handle(handle)
            return
        except Exception:
            with contextlib.suppress(Exception):
                if agent.check_xfer_state(handle) != "PROC":
                    continue
            time.sleep(POLL_S)
    log.warning("a NIXL READ abandoned mid-transfer could not be released")
