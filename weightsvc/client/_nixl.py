"""Pulls over NIXL, in place: a lease of the version from the server, one-sided READs of exactly the
leased ranges into the caller's tensors, the release, then every byte checked against the manifest's
checksums, as any pull's.

The caller's tensors are preallocated (as vLLM's staging is) and contiguous, one per tensor of the
version or of the selection, of its served dtype and size. What they hold after a pull that failed
is not to be used. When NIXL cannot be had (not installed, a server without --nixl, a READ that
cannot reach it), the pull says so in one line and goes over TCP, unless told not to.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from weightsvc.errors import DataLoss, DeadlineExceeded, InvalidArgument, Unavailable, subject
from weightsvc.protocol.digest import verify
from weightsvc.protocol.fabric import Lease, nixl_agent_class
from weightsvc.protocol.manifest import Manifest

if TYPE_CHECKING:
    import torch

log = logging.getLogger("weightsvc.client")

POLL_S = 0.0002  # between looks at a READ in progress (NIXL's Python API has no wait)


class Reader:
    """This process's NIXL agent, which READs leased memory into the caller's tensors (one at a time)."""

    def __init__(self) -> None:
        self.agent = nixl_agent_class()(f"weightsvc-reader-{os.getpid()}-{secrets.token_hex(4)}")
        self._lock = threading.Lock()

    def read(self, lease: Lease, into: Mapping[str, torch.Tensor], where: str) -> None:
        """READ every range of `lease` into the tensor of its name; UNAVAILABLE when NIXL cannot reach
        the source, DEADLINE_EXCEEDED when the READ outlasts the lease."""
        local: list[tuple[int, int, int]] = []
        remote: list[tuple[int, int, int]] = []
        for t in lease.manifest.tensors:
            at = into[t.name].data_ptr()
            for r in lease.ranges[t.name]:
                local.append((at, r.nbytes, 0))
                remote.append((r.addr, r.nbytes, r.device))
                at += r.nbytes
        if not local:
            return
        deadline = time.monotonic() + lease.lease_s
        with self._lock:
            destination = [into[t.name] for t in lease.manifest.tensors if t.nbytes]
            try:
                peer = self.agent.add_remote_agent(lease.agent)
            except Exception as e:
                raise Unavailable(f"{where}: the server's NIXL agent cannot be added: {type(e).__name__}: {e}"
                                  ) from None
            try:
                registered = self.agent.register_memory(destination)
                try:
                    self._transfer(local, remote, peer, lease.memory, deadline, where)
                finally:
                    self.agent.deregister_memory(registered)
            finally:
                self.agent.remove_remote_agent(peer)  # (its metadata names what was registered then: new next time)

    def _transfer(self, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]], peer: Any,
                  memory: str, deadline: float, where: str) -> None:
        try:
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                self.agent.get_xfer_descs(remote, memory), peer)
        except Exception as e:
            raise Unavailable(f"{where}: NIXL cannot READ from the server: {type(e).__name__}: {e}") from None
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"{where}: the NIXL READ outlasted its lease", reason="expired")
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise Unavailable(f"{where}: the NIXL READ from the server failed ({state})")
        finally:
            self.agent.release_xfer_handle(handle)


def check_destination(manifest: Manifest, into: Mapping[str, torch.Tensor]) -> None:
    """INVALID_ARGUMENT naming the first tensor of `manifest` that `into` lacks, or holds in memory a
    READ cannot fill: not contiguous, not on the CPU, of another dtype or size."""
    from weightsvc.client._tensors import TORCH_DTYPES

    for t in manifest.tensors:
        what = subject(manifest.model, manifest.version, tensor=t.name)
        dst = into.get(t.name)
        if dst is None:
            raise InvalidArgument(f"{what}: no tensor of that name to read it into")
        dtype = TORCH_DTYPES.get(t.dtype)
        if dst.dtype != dtype or dst.numel() * dst.element_size() != t.nbytes:
            raise InvalidArgument(f"{what} is {t.dtype} of shape {list(t.shape)} ({t.nbytes} bytes): the tensor to "
                                  f"read it into is {dst.dtype} of shape {list(dst.shape)}")
        if dst.device.type != "cpu" or not dst.is_contiguous():
            raise InvalidArgument(f"{what}: the tensor to read it into must be contiguous and on the CPU "
                                  f"(it is on {dst.device}{'' if dst.is_contiguous() else ', not contiguous'})")


def check_lease(lease: Lease, where: str) -> None:
    """DATA_LOSS unless the lease names exactly the bytes of each tensor of its manifest."""
    m = lease.manifest
    for t in m.tensors:
        ranges = lease.ranges.get(t.name)
        if ranges is None or sum(r.nbytes for r in ranges) != t.nbytes or any(r.nbytes <= 0 for r in ranges):
            raise DataLoss(f"{subject(m.model, m.version, tensor=t.name)}: the lease does not name exactly its "
                           f"{t.nbytes} bytes")
    if len(lease.ranges) != len(lease.manifest.tensors):
        raise DataLoss(f"{where}: the lease names tensors its manifest lacks")


def verify_into(manifest: Manifest, into: Mapping[str, torch.Tensor]) -> None:
    """Every tensor read checked against its checksum (xxh3 of its bytes, as any pull's)."""
    import torch

    where = subject(manifest.model, manifest.version)
    for t in manifest.tensors:
        dst = into[t.name]
        verify(t.name, dst.reshape(-1).view(torch.uint8).numpy(), t.checksum, where=where)


def copy_into(manifest: Manifest, data: memoryview, into: Mapping[str, torch.Tensor]) -> None:
    """The bytes of a pull over TCP (verified) copied into the caller's tensors."""
    import numpy as np
    import torch

    for t in manifest.tensors:
        dst = into[t.name].reshape(-1).view(torch.uint8).numpy()
        dst[:] = np.frombuffer(data, np.uint8, count=t.nbytes, offset=t.offset)


def pull_into(lease: Callable[[], Lease], release: Callable[[str], None], reader: Callable[[], Reader],
              into: Mapping[str, torch.Tensor], where: str) -> Manifest:
    """One pull over NIXL: lease, READ, release, verify. UNAVAILABLE (reason nixl_off) when NIXL cannot
    be had; DEADLINE_EXCEEDED when the lease expired first; INVALID_ARGUMENT for tensors it cannot
    fill; DATA_LOSS for a lease or bytes that are not what the manifest says."""
    agent = reader()  # (before the lease: without NIXL there is nothing to hold)
    lent = lease()
    try:
        check_lease(lent, where)
        check_destination(lent.manifest, into)
        agent.read(lent, into, where)
    except BaseException:
        try:
            release(lent.lease_id)
        except DeadlineExceeded:  # the READ failed because the lease ran out (its memory deregistered): say that
            raise
        except Exception as e:  # the pull fails for its own reason; the lease ends by its deadline anyway
            log.debug("%s: the lease was not released: %s", where, e)
        raise
    release(lent.lease_id)  # DEADLINE_EXCEEDED: expired before the READ was done, its bytes not vouched for
    verify_into(lent.manifest, into)
    return lent.manifest

