"""Sharded replicas publishing to the object store: a version whole, its parts pulled from their
holders by a client of this replica, as a relay of the replicas pulls one (`service.publish`)."""

from __future__ import annotations

import threading

from weightsvc.client import InferenceClient, Limits
from weightsvc.errors import Unavailable, subject
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.topology import Replica
from weightsvc.settings import Settings
from weightsvc.transport.auth import configured_tokens


class Gatherer:
    """`Gather`: blocking, called from the publisher's thread. Its client reaches this replica as the
    others do (its advertised address), with the first token configured here (every role may pull)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._target: str | None = None  # this replica's address, once it serves
        self._client: InferenceClient | None = None  # made at the first call
        self._lock = threading.Lock()

    def serving(self, replica: Replica) -> None:
        """This replica listens at `replica.grpc` from now on."""
        self._target = replica.grpc

    def __call__(self, model: str, version: int) -> tuple[Manifest, memoryview]:
        with self._lock:
            if self._client is None and self._target is not None:
                s = self._settings
                tokens = [t.strip() for listed in configured_tokens(s.tokens(), s.auth_file).values() for t in listed]
                self._client = InferenceClient(self._target, token=next((t for t in tokens if t), None),
                                               limits=Limits(s.max_version_bytes, s.max_tensors))
            client = self._client
        if client is None:
            raise Unavailable(f"{subject(model, version)}: this replica does not serve yet; its parts are gathered "
                              "once it does")
        return client.pull_data(model, version)

    def close(self) -> None:
        with self._lock:
            client, self._client, self._target = self._client, None, None
        if client is not None:
            client.close()
