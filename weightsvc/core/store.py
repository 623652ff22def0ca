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

from weightsvc.core.acks import CLIENT_TIMEOUT_S, Acks, ClientAck
from weightsvc.core.commit import Committer
from weightsvc.core.lag import Sample
from weightsvc.core.manifest import Manifest
from weightsvc.core.memory import BufferPool
from weightsvc.core.parts import PartOf, Parts
from weightsvc.core.persist import VersionFiles
from weightsvc.core.registry import MemoryRegistry, Registry
from weightsvc.core.versions import Version, VersionIndex
from weightsvc.metrics import Metrics
from weightsvc.rounding import Residual

__all__ = ["CLIENT_TIMEOUT_S", "ClientAck", "PartOf", "Version", "VersionStore"]


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

    @property
    def pool(self) -> BufferPool:
        return self.index.pool

    @property
    def replica_id(self) -> str:
        """This server's id in the topology (set when it registers)."""
        return self.parts.replica_id

    @replica_id.setter
    def replica_id(self, replica_id: str) -> None:
        self.parts.replica_id = replica_id

    # ---- reads: the index ----------------------------------------------------------------------

    def models(self) -> list[str]:
        return self.index.models()

    def latest(self, model: str) -> int | None:
        return self.index.latest(model)

    def versions(self, model: str) -> list[Version]:
        return self.index.versions(model)

    def get(self, model: str, version: int | None) -> Version:
        return self.index.get(model, version)

    def hold(self, version: Version) -> None:
        self.index.hold(version)

    def release(self, version: Version) -> None:
        self.index.release(version)

    async def watch(self, model: str, after: int | None) -> AsyncIterator[Manifest]:
        """Every retained version above `after` (all when None), then each new one as it commits."""
        async for v in self.registry.events(model, -1 if after is None else after):
            version = await self.index.shown(model, v)
            if version is not None:  # else already evicted: a newer one follows
                yield version.manifest

    # ---- commit and restart: the committer -------------------------------------------------------

    def check_step(self, model: str, step: int) -> None:
        self.committer.check_step(model, step)

    def residual(self, model: str, format: str, scaling: str) -> Residual:
        return self.committer.residual(model, format, scaling)

    async def commit(
        self,
        version: Version,
        residual: tuple[int | None, Residual] | None = None,
        lag_input: tuple[Sample, int, bool] | None = None,
        part_of: PartOf | None = None,
    ) -> tuple[Version, bool]:
        return await self.committer.commit(version, residual, lag_input, part_of)

    def restore(self) -> int:
        return self.committer.restore()

    async def sync_registry(self) -> None:
        await self.committer.sync_registry()

    # ---- staleness: the acks ---------------------------------------------------------------------

    def ack(self, model: str, version: int, client_id: str) -> int:
        return self.acks.ack(model, version, client_id)

    async def flush_acks(self) -> None:
        await self.acks.flush()

    def clients(self, model: str) -> list[ClientAck]:
        return self.acks.clients(model)

    def client_lags(self) -> dict[str, list[int]]:
        return self.acks.client_lags()

    def versions_behind(self, model: str, version: int) -> int:
        return self.acks.versions_behind(model, version)
