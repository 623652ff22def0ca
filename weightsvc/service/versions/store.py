"""The version store: committed versions per model, retention, persistence, events and acks.

`VersionStore` wires five parts, each with its own module, and keeps the calls the service and the
transports make:
- `VersionIndex` (versions.py): the retained versions, lookups, pulls holding a version, eviction
  and the recycling of buffers;
- `Committer` (commit.py): commit through the registry, durable with a data dir, and at a restart
  the files read back and made to agree with the registry;
- `Parts` (parts.py): a sharded replica's part of a version, waiting for the other owners' parts;
- `Acks` (acks.py): the clients' acks and how many versions behind they serve;
- `VersionFiles` (persist.py): the data dir's files, blocking I/O off the event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from weightsvc.metrics import Metrics
from weightsvc.protocol.manifest import Manifest
from weightsvc.service.replicas.memory import MemoryRegistry
from weightsvc.service.replicas.parts import PartOf, Parts
from weightsvc.service.replicas.registry import Registry
from weightsvc.service.versions.acks import CLIENT_TIMEOUT_S, Acks, ClientAck, ClientStatus
from weightsvc.service.versions.commit import Committer
from weightsvc.service.versions.disk import VersionFiles
from weightsvc.service.versions.index import Version, VersionIndex

__all__ = ["CLIENT_TIMEOUT_S", "ClientAck", "ClientStatus", "PartOf", "Version", "VersionStore"]


class VersionStore:
    def __init__(
        self, *, retain: int, data_dir: Path | None, metrics: Metrics, registry: Registry | None = None
    ) -> None:
        # Decides commits and carries events and acks; this store holds the bytes.
        self.registry: Registry = registry if registry is not None else MemoryRegistry()
        self.index = VersionIndex(retain, metrics)
        self.files = VersionFiles(data_dir) if data_dir is not None else None
        self.parts = Parts(self.registry, retain)
        self.acks = Acks(self.index, self.registry, metrics)
        self.committer = Committer(
            index=self.index,
            files=self.files,
            parts=self.parts,
            acks=self.acks,
            registry=self.registry,
            metrics=metrics,
        )
        # The calls the service and the transports make, each answered by the part that owns it
        # (bound here rather than forwarded, so that each signature is written once).
        self.pool = self.index.pool
        self.models = self.index.models
        self.latest = self.index.latest
        self.versions = self.index.versions
        self.get = self.index.get
        self.hold = self.index.hold
        self.release = self.index.release
        self.check_step = self.committer.check_step
        self.residual = self.committer.residual
        self.commit = self.committer.commit
        self.on_disk = self.committer.on_disk
        self.restore = self.committer.restore
        self.sync_registry = self.committer.sync_registry
        self.ack = self.acks.ack
        self.flush_acks = self.acks.flush
        self.clients = self.acks.clients
        self.versions_behind = self.acks.versions_behind

    @property
    def replica_id(self) -> str:
        """This server's id in the topology (set when it registers)."""
        return self.parts.replica_id

    @replica_id.setter
    def replica_id(self, replica_id: str) -> None:
        self.parts.replica_id = replica_id

    async def watch(self, model: str, after: int | None) -> AsyncIterator[Manifest]:
        """Every retained version above `after` (all when None), then each new one as it commits."""
        async for v in self.registry.events(model, -1 if after is None else after):
            version = await self.index.shown(model, v)
            if version is not None:  # else already evicted: a newer one follows
                yield version.manifest
