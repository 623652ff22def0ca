"""Sharded replicas: following the registry. Every version the registry commits is shown, also one
this replica holds no part of (it was down, or left out of the push): it serves its manifest, and
clients fetch the bytes from the replicas that hold them. A replica that returns thus catches up.

Loop-owned: every method runs on the service's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from weightsvc.errors import Unavailable, WeightsvcError, subject
from weightsvc.service.record import Version
from weightsvc.service.replicas.parts import Parts
from weightsvc.service.replicas.registry import Registry, manifest_from_registry
from weightsvc.service.versions.acks import Acks
from weightsvc.service.versions.index import VersionIndex

log = logging.getLogger("weightsvc.store")
FOLLOW_MODELS_S = 2.0  # how soon a sharded replica follows a model that is new to it
RETRY_S = 1.0  # how soon a model's events are read again after the registry went away


class CommitFollower:
    """Shows in the index what the registry committed without this replica. `locks` are the
    committer's, per model: a version is added under its model's lock, as a commit adds one. `lost`
    is called when the registry no longer knows a model this replica shows (it lost its data)."""

    def __init__(
        self, *, index: VersionIndex, parts: Parts, acks: Acks, registry: Registry, locks: dict[str, asyncio.Lock],
        lost: Callable[[], None],
    ) -> None:
        self._index = index
        self._parts = parts
        self._acks = acks
        self._registry = registry
        self._locks = locks
        self._lost = lost

    async def follow(self) -> None:
        """Show every version the registry commits, of every model, until cancelled."""
        following: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                try:
                    models = await self._registry.models()
                    if set(self._index.models()) - set(models):
                        self._lost()
                    for model in models:
                        if model not in following or following[model].done():
                            following[model] = asyncio.create_task(self._follow(model), name=f"follow-{model}")
                        await self._show_given_back(model)
                except Unavailable:
                    pass  # the registry is away: the models it knows are followed once it is back
                except WeightsvcError as e:  # (one unreadable manifest must not end the following)
                    log.error("following the registry: %s", e)
                await asyncio.sleep(FOLLOW_MODELS_S)  # (no event announces a new model)
        finally:
            for task in following.values():
                task.cancel()

    async def catch_up(self, model: str | None = None) -> None:
        """Show now every version the registry committed above what this replica shows (of `model`,
        or of every model): before it joins the topology, and before a sharded push exports, so that
        it decides from the latest version (which ef residuals go on) as the other owners do."""
        for m in [model] if model is not None else await self._registry.models():
            latest = self._index.latest(m)
            for v in await self._registry.versions(m):
                if (latest is None or v > latest) and self._index.find(m, v) is None:
                    await self._show_committed_elsewhere(m, v, held_too=True)

    async def _show_given_back(self, model: str) -> None:
        """Show the versions the registry holds again and this replica lacks: versions given back by
        their holders after the registry lost its data come with no event."""
        shown = self._index.versions(model) if model in self._index.models() else []
        oldest = shown[0].manifest.version if len(shown) >= self._index.retain else -1
        for v in await self._registry.versions(model):
            if v > oldest and self._index.find(model, v) is None:
                await self._show_committed_elsewhere(model, v)

    async def _follow(self, model: str) -> None:
        while True:
            try:
                async for v in self._registry.events(model, -1):
                    if self._index.find(model, v) is None:
                        await self._show_committed_elsewhere(model, v)
            except Unavailable:
                await asyncio.sleep(RETRY_S)

    async def _show_committed_elsewhere(self, model: str, v: int, held_too: bool = False) -> None:
        """Show version `v`, which the registry committed, if this replica holds no part of it (or,
        `held_too`, if it shows nothing of it: its part's file was lost)."""
        raw = await self._registry.manifest(model, v)
        if raw is None:
            return
        whole = await asyncio.to_thread(manifest_from_registry, raw, subject(model, v))
        if not whole.parts:
            return  # one server holds it whole: clients pull it there
        if not held_too and self._parts.replica_id in {h for p in whole.parts for h in p.sources}:
            return  # this replica holds a part: its own commit (or restore) shows the version
        version = await asyncio.to_thread(Version.elsewhere, whole)
        async with self._locks.setdefault(model, asyncio.Lock()):
            if self._index.find(model, v) is not None:
                return  # its own commit showed it meanwhile
            self._index.add(version)
            self._acks.committed(model, v, whole.committed_unix)
        log.info("model %s version %d: committed without this replica; served from the replicas that hold it",
                 model, v)
        await self._index.announce()
