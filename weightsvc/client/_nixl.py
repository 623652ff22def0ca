"""Pulls over NIXL, in place: a lease of the version from a server, one-sided READs of exactly the
leased ranges into the caller's tensors, the release, and every byte checked against the manifest's
checksums, as any pull's. The READ goes in pieces of 64 MiB, two in flight, each piece's bytes hashed
as it lands (while they are still in cache): the checksums cost little beyond the READ.

The caller's tensors are preallocated (as vLLM's staging is) and contiguous, one per tensor of the
version or of the selection, of its served dtype and size, all in host memory or all on one GPU
(registered as VRAM: the READ lands there). What they hold after a pull that failed is not to be
used. When NIXL cannot be had (not installed, a server without --nixl, a READ that cannot reach it),
the pull says so in one line and goes over TCP, unless told not to.

Delta reads: a caller whose tensors hold an earlier version (`base`) is lent the delta encoding against
it when the server has one; it READs the encoding into a buffer of its own and patches its tensors in
place (host memory only: on a GPU the whole version is read).

Sources: a lease names the other servers that lend the same version. When a READ fails (the source
died, or cannot be reached), the reader moves to the next one and reads the same version there, from
the start; the sources a client was told of are remembered for its next pull, when its own server may
be the one that is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from weightsvc.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    WeightsvcError,
    subject,
)
from weightsvc.protocol import delta as delta_codec
from weightsvc.protocol.digest import CHECKSUM_PREFIX, verify, verify_checksum
from weightsvc.protocol.fabric import PIECE, Lease, Piece, cut_pieces, new_agent, read_pieces
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.selection import Select

if TYPE_CHECKING:
    import torch

log = logging.getLogger("weightsvc.client")



class Source(Protocol):
    """A server a lease is asked of: an `InferenceClient` of its target."""

    target: str

    def _lease(self, model: str, version: str, select: Select | None, lease_s: float,
               base: int | None = None) -> Lease: ...

    def _release(self, lease_id: str) -> None: ...


class Reader:
    """This process's NIXL agent, which READs leased memory into the caller's tensors (one at a time)."""

    def __init__(self) -> None:
        self.agent = new_agent(f"weightsvc-reader-{os.getpid()}-{secrets.token_hex(4)}")
        self._lock = threading.Lock()
        self._peer: tuple[bytes, str] | None = None  # (metadata, name) of the source last READ from

    def read(self, lease: Lease, into: Mapping[str, torch.Tensor], where: str) -> dict[str, str]:
        """READ every range of `lease` into the tensor of its name (or, for a delta, the encoding into
        `into[""]`), and answer the checksum of each tensor's bytes read (none for a delta: its bytes
        are checked once patched). The READ goes in pieces of at most PIECE bytes, the next one moving
        while the last one's bytes are hashed. UNAVAILABLE when NIXL cannot reach the source or it goes
        away mid-READ, DEADLINE_EXCEEDED when the READ outlasts the lease."""
        delta = lease.base is not None
        tensors = {"": lease.delta} if delta else {t.name: lease.ranges[t.name] for t in lease.manifest.tensors}
        pieces = _pieces({name: (into[name], ranges) for name, ranges in tensors.items()})
        sums = {} if delta else {name: xxhash.xxh3_64() for name in tensors}  # (each fed its bytes in order)
        destination = [into[name] for name, ranges in tensors.items() if ranges]

        def hash_piece(piece: Piece) -> None:
            for name, start, end in piece.spans if not delta else ():
                sums[name].update(_host_bytes(into[name], start, end))

        if destination:
            deadline = time.monotonic() + lease.lease_s
            with self._lock:
                peer = self._peer_of(lease.agent, where)
                try:
                    registered = self.agent.register_memory(destination)
                    try:
                        self._transfer(pieces, peer, _memory(destination[0]), lease.memory, deadline, where, hash_piece)
                    finally:
                        self.agent.deregister_memory(registered)
                except BaseException:
                    self._forget_peer()  # (gone, perhaps: added again next time)
                    raise
        return {name: CHECKSUM_PREFIX + s.hexdigest() for name, s in sums.items()}

    def _peer_of(self, metadata: bytes, where: str) -> str:
        """The source's agent, added from its metadata, or kept from the last READ when its metadata is
        the same: the same agent with the same memory registered, and a connection already made."""
        if self._peer is not None and self._peer[0] == metadata:
            return self._peer[1]
        self._forget_peer()
        try:
            peer: str = self.agent.add_remote_agent(metadata)
        except Exception as e:
            raise Unavailable(f"{where}: the server's NIXL agent cannot be added: {type(e).__name__}: {e}") from None
        self._peer = (metadata, peer)
        return peer

    def _forget_peer(self) -> None:
        if self._peer is not None:
            _, peer = self._peer
            self._peer = None
            with contextlib.suppress(Exception):  # (a source that went away may be gone from the agent already)
                self.agent.remove_remote_agent(peer)

    def _transfer(self, pieces: list[Piece], peer: Any, local_memory: str, remote_memory: str, deadline: float,
                  where: str, done: Callable[[Piece], None]) -> None:
        """READ the pieces, two in flight: `done` is called with each one once its bytes are in."""
        read_pieces(self.agent, pieces, peer, local_memory, remote_memory, deadline=deadline, where=where,
                    source="the server", late="the NIXL READ outlasted its lease", done=done)


def _pieces(tensors: Mapping[str, tuple[torch.Tensor, list[Any]]]) -> list[Piece]:
    """The ranges of each tensor (READ into it one after another) cut into pieces of at most PIECE bytes."""
    return cut_pieces(((name, dst.data_ptr(), _device(dst), ranges) for name, (dst, ranges) in tensors.items()), PIECE)


def _device(t: torch.Tensor) -> int:
    return t.device.index or 0 if t.device.type == "cuda" else 0


def _memory(t: torch.Tensor) -> str:
    return "VRAM" if t.device.type == "cuda" else "DRAM"


def check_destination(manifest: Manifest, into: Mapping[str, torch.Tensor]) -> None:
    """INVALID_ARGUMENT naming the first tensor of `manifest` that `into` lacks, or holds in memory a
    READ cannot fill: not contiguous, of another dtype or size, neither in host memory nor on the GPU
    the others are on."""
    from weightsvc.client._tensors import TORCH_DTYPES

    devices = {dst.device for dst in into.values()}
    if len(devices) > 1:
        raise InvalidArgument(f"{subject(manifest.model, manifest.version)}: the tensors to read it into are on "
                              f"{sorted(map(str, devices))}: put them all in host memory or all on one GPU")
    for t in manifest.tensors:
        what = subject(manifest.model, manifest.version, tensor=t.name)
        dst = into.get(t.name)
        if dst is None:
            raise InvalidArgument(f"{what}: no tensor of that name to read it into")
        dtype = TORCH_DTYPES.get(t.dtype)
        if dst.dtype != dtype or dst.numel() * dst.element_size() != t.nbytes:
            raise InvalidArgument(f"{what} is {t.dtype} of shape {list(t.shape)} ({t.nbytes} bytes): the tensor to "
                                  f"read it into is {dst.dtype} of shape {list(dst.shape)}")
        if dst.device.type not in ("cpu", "cuda") or not dst.is_contiguous():
            raise InvalidArgument(f"{what}: the tensor to read it into must be contiguous, in host memory or on "
                                  f"a GPU (it is on {dst.device}{'' if dst.is_contiguous() else ', not contiguous'})")


def check_lease(lease: Lease, where: str) -> None:
    """DATA_LOSS unless the lease names exactly the bytes of each tensor of its manifest, or, for a
    delta, at most the bytes the largest encoding of its manifest has."""
    m = lease.manifest
    if any(r.nbytes <= 0 for r in lease.delta):
        raise DataLoss(f"{where}: the lease names an empty range of the delta encoding")
    if lease.base is not None:
        if lease.ranges or lease.delta_bytes > delta_codec.most_bytes(m):
            raise DataLoss(f"{where}: the lease of a delta names {lease.delta_bytes} bytes, more than an encoding "
                           f"of its {len(m.tensors)} tensors can have, or tensors too")
        return
    if lease.delta:
        raise DataLoss(f"{where}: the lease names a delta encoding, but no version it applies to")
    for t in m.tensors:
        ranges = lease.ranges.get(t.name)
        if ranges is None or sum(r.nbytes for r in ranges) != t.nbytes or any(r.nbytes <= 0 for r in ranges):
            raise DataLoss(f"{subject(m.model, m.version, tensor=t.name)}: the lease does not name exactly its "
                           f"{t.nbytes} bytes")
    if len(lease.ranges) != len(lease.manifest.tensors):
        raise DataLoss(f"{where}: the lease names tensors its manifest lacks")


def _host_bytes(t: torch.Tensor, start: int = 0, end: int | None = None) -> Any:
    """The bytes of a tensor (from `start` to `end`) as a numpy array; on a GPU they are copied to host
    memory first (their checksum is computed there: xxh3 runs on the CPU)."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)[start:end]
    return (flat.cpu() if flat.device.type != "cpu" else flat).numpy()


def verify_into(manifest: Manifest, into: Mapping[str, torch.Tensor]) -> None:
    """Every tensor read checked against its checksum (xxh3 of its bytes, as any pull's)."""
    where = subject(manifest.model, manifest.version)
    for t in manifest.tensors:
        verify(t.name, _host_bytes(into[t.name]), t.checksum, where=where)


def copy_into(manifest: Manifest, data: memoryview, into: Mapping[str, torch.Tensor]) -> None:
    """The bytes of a pull over TCP (verified) copied into the caller's tensors."""
    import numpy as np
    import torch

    for t in manifest.tensors:
        src = torch.from_numpy(np.frombuffer(data, np.uint8, count=t.nbytes, offset=t.offset))
        into[t.name].reshape(-1).view(torch.uint8).copy_(src)


def patch_into(manifest: Manifest, encoding: memoryview, into: Mapping[str, torch.Tensor], where: str) -> None:
    """The delta encoding applied to the caller's tensors (host memory), which hold its base; DATA_LOSS
    for an encoding that is not one of `manifest`."""
    import torch

    try:
        delta_codec.apply_to(manifest, encoding, {t.name: into[t.name].reshape(-1).view(torch.uint8).numpy()
                                                  for t in manifest.tensors})
    except (ValueError, IndexError) as e:
        raise DataLoss(f"{where}: the delta encoding read is not one of its tensors: {e}") from None


def _read_at(source: Source, lent: Lease, agent: Reader, into: Mapping[str, torch.Tensor], where: str) -> Manifest:
    """READ what `lent` names, release it, patch (a delta) and verify. The lease is released on every
    way out; a READ that outlasted it is DEADLINE_EXCEEDED."""
    import torch

    m = lent.manifest
    scratch: dict[str, torch.Tensor] = {}
    try:
        check_lease(lent, where)
        check_destination(m, into)
        if lent.base is not None:
            scratch[""] = torch.empty(lent.delta_bytes, dtype=torch.uint8)
        sums = agent.read(lent, {**into, **scratch}, where)
    except BaseException:
        try:
            source._release(lent.lease_id)
        except DeadlineExceeded:  # the READ failed because the lease ran out (its memory deregistered): say that
            raise
        except Exception as e:  # the pull fails for its own reason; the lease ends by its deadline anyway
            log.debug("%s: the lease was not released: %s", where, e)
        raise
    source._release(lent.lease_id)  # DEADLINE_EXCEEDED: expired before the READ was done, its bytes not vouched for
    if lent.base is not None:
        patch_into(m, scratch[""].numpy().data, into, where)
        verify_into(m, into)
    else:
        for t in m.tensors:
            verify_checksum(t.name, sums[t.name], t.checksum, where=where)
    return m


def pull_into(first: Source, open_source: Callable[[str], Source], known: list[str], reader: Callable[[], Reader],
              into: Mapping[str, torch.Tensor], model: str, version: str, select: Select | None, base: int | None,
              lease_s: float) -> Manifest:
    """One pull over NIXL: lease, READ, release, verify, at `first`, then at each other source the
    leases name (and those `known` from earlier pulls, which this one updates) while READs fail.
    UNAVAILABLE (reason nixl_off) when NIXL cannot be had; DEADLINE_EXCEEDED when the lease expired
    first; INVALID_ARGUMENT for tensors it cannot fill; DATA_LOSS for a lease or bytes that are not
    what the manifest says; when every source failed, the first one's error, or UNAVAILABLE naming each."""
    agent = reader()  # (before the lease: without NIXL there is nothing to hold)
    if base is not None and any(t.device.type != "cpu" for t in into.values()):
        base = None  # the encoding is applied on the CPU: a GPU's tensors are read whole
    where = subject(model, version)
    targets = [first.target, *(s for s in known if s != first.target)]
    failed: list[tuple[str, WeightsvcError]] = []
    for i, target in enumerate(targets):
        try:
            source = first if i == 0 else open_source(target)
            lent = source._lease(model, version, select, lease_s, base)
        except (Unavailable, FailedPrecondition, NotFound) as e:
            if (i == 0 and isinstance(e, NotFound)) or len(targets) == 1:
                raise  # (a version its own server does not have: no other source is asked)
            failed.append((target, e))
            continue
        version, where = str(lent.manifest.version), subject(model, lent.manifest.version)  # the same one everywhere
        for s in lent.sources:
            if s not in targets:
                targets.append(s)
        known[:] = [s for s in targets if s != first.target]
        try:
            m = _read_at(source, lent, agent, into, where)
        except Unavailable as e:
            failed.append((target, e))
            if len(targets) > i + 1:
                log.warning("%s: the NIXL READ from %s failed (%s): moving to %s", where, target, e.message,
                            targets[i + 1])
            continue
        return m
    if len(failed) == 1:
        raise failed[0][1]
    raise Unavailable(f"{where}: no source could lend it over NIXL: "
                      + "; ".join(f"{target}: {e.message}" for target, e in failed))

