"""`InferenceClient("s3://BUCKET/PREFIX")`: pulls versions from an object store that a weightsvc
server writes through to (`--object-store`), without any server: the latest or a given version,
whole, as the deltas after a version held, or a selection; `watch` polls the store.

The store's endpoint, region and credentials come from the environment (`weightsvc.store.s3`).
A store has no server to take acks, report clients or a topology: `ack` only returns the latest
version, and the rest are FAILED_PRECONDITION. What it holds that is damaged is no version: listings
and `latest` pass over it, and `damaged_files` names it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

from weightsvc.client._base import InferenceClient
from weightsvc.client._common import Progress, Receiver, VersionInfo
from weightsvc.errors import FailedPrecondition, NotFound
from weightsvc.protocol.clients import ClientStatus
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.refs import parse_version_ref
from weightsvc.protocol.selection import Select
from weightsvc.protocol.topology import Replica
from weightsvc.store import Bucket, StoreReader, StoreUrl

POLL_S = 1.0  # how often a watch lists the store's versions


class StoreInferenceClient(InferenceClient):
    """Pulls from an object store (`s3://BUCKET/PREFIX`); every tensor verified as from a server."""

    transport = "s3"

    def __init__(self, target: str, *, poll_s: float = POLL_S, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self.url = StoreUrl.parse(target)
        self.poll_s = poll_s
        self._opened: list[StoreReader] = []  # the reader, once opened (boto3 takes a second to load)
        self._opening = threading.Lock()
        self._stop = threading.Event()
        self._own(functools.partial(_release, self._stop, self._opened))

    @property
    def _reader(self) -> StoreReader:
        with self._opening:
            if not self._opened:
                timeout = self.timeout if self.timeout is not None else 30.0
                self._opened.append(StoreReader(Bucket(self.url, timeout=timeout)))
            return self._opened[0]

    def _pull(self, model: str, version: str, held: tuple[Manifest, memoryview] | None, moved: Progress, *,
              select: Select | None = None, owner: str | None = None) -> tuple[Manifest, memoryview]:
        def check(m: Manifest) -> Manifest:
            return self.limits.check(m, model, m.version)

        def attempt() -> tuple[Manifest, memoryview]:
            marker = self._reader.marker(model, parse_version_ref(version))
            if select is not None:
                return self._reader.selection(marker, select, moved, check)
            return marker.manifest, self._reader.load(marker, held, moved, check)

        return self.retry.run(attempt)

    def _pull_part(self, manifest: Manifest, source: str, rx: Receiver) -> None:
        raise FailedPrecondition(f"{self.target}: an object store holds whole versions, not parts of replicas")

    def _events(self, model: str, after: int | None) -> Iterator[VersionInfo]:
        """Each version above `after`, then each new one, by listing the store every `poll_s` seconds
        (a version shows once its marker is written)."""
        last = after
        while not self._stop.is_set():
            try:
                found = self._reader.versions(model)
            except NotFound:
                found = []  # not yet: the watch waits for the model's first version
            for version in found:
                if last is None or version > last:
                    yield VersionInfo.from_dict(self._reader.marker(model, version).info())
                    last = version
            self._stop.wait(self.poll_s)

    def manifest(self, model: str = "default", version: int | str = "latest") -> Manifest:
        return self.limits.check(self._reader.marker(model, parse_version_ref(version)).manifest, model, version)

    def versions(self, model: str = "default") -> list[VersionInfo]:
        return [VersionInfo.from_dict(self._reader.marker(model, v).info()) for v in self._reader.versions(model)]

    def models(self) -> list[dict[str, Any]]:
        out = []
        for model in self._reader.models():
            try:
                versions = self._reader.versions(model)
            except NotFound:
                continue  # (objects of a version whose marker never came)
            out.append({"model": model, "latest_version": versions[-1], "versions": versions})
        return out

    def damaged_files(self) -> list[dict[str, str]]:
        """What the store holds that is no version (listings and `latest` pass over it): each damaged
        commit marker, and each folder no model can be named after; `file` is its URL."""
        return [{"model": d.model, "file": f"{self.url}/{d.name}", "reason": d.reason} for d in self._reader.damaged()]

    def topology(self) -> list[Replica]:
        raise FailedPrecondition(f"{self.target}: an object store has no replicas; ask a server")

    def _ack(self, model: str, version: int, client_id: str) -> int:
        """Nothing takes acks at a store: the latest version, as a server answers."""
        return self._reader.versions(model)[-1]

    def clients(self, model: str = "default") -> list[ClientStatus]:
        raise FailedPrecondition(f"{self.target}: an object store takes no acks, so knows no clients; ask a server")


def _release(stop: threading.Event, opened: list[StoreReader]) -> None:
    stop.set()  # a watch waiting to list the store again ends
    for reader in opened:
        reader.bucket.close()
