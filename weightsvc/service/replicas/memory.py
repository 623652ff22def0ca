"""The registry of one process: the embedded default, when no Redis is configured."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from weightsvc.protocol.topology import REPLICA_TTL_S, Replica
from weightsvc.service.replicas.registry import (
    ACKS_KEPT,
    CommitResult,
    MismatchRecord,
    band_conflict,
    check_commit,
    combined_digest,
    conflict,
    diverged_error,
    not_above,
    part_rule,
    totals_overflow,
)


class MemoryRegistry:
    """The registry of one process: its state in dicts, its events a condition."""

    def __init__(self) -> None:
        self._manifests: dict[str, dict[int, tuple[str, str]]] = {}  # model -> version -> (digest, manifest)
        self._acks: dict[str, dict[str, tuple[int, float, str]]] = {}  # in order of last ack
        self._replicas: dict[str, Replica] = {}
        self._mismatch: dict[str, dict[int, MismatchRecord]] = {}
        self._pending: dict[tuple[str, int, str], dict[str, str]] = {}  # parts of versions not yet complete
        self._changed = asyncio.Condition()

    async def commit(self, model: str, version: int, digest: str, manifest: str, retain: int) -> CommitResult:
        vs = self._manifests.setdefault(model, {})
        if not check_commit(model, version, digest, vs[version][0] if version in vs else None, max(vs, default=None)):
            return CommitResult(created=False)
        vs[version] = (digest, manifest)
        evicted = _retain(vs, retain)
        async with self._changed:
            self._changed.notify_all()
        return CommitResult(created=True, evicted=evicted)

    async def restore(self, model: str, version: int, digest: str, manifest: str, retain: int) -> bool:
        vs = self._manifests.setdefault(model, {})
        if version in vs:
            if vs[version][0] != digest:
                raise conflict(model, version, vs[version][0], digest)
            return True
        vs[version] = (digest, manifest)
        return version not in _retain(vs, retain)

    async def commit_part(
        self, model: str, version: int, owner: str, owners: Sequence[str], digest: str, manifest: str, retain: int,
        groups: Mapping[str, str] | None = None,
    ) -> CommitResult | None:
        owners = sorted(owners)
        vs = self._manifests.get(model, {})
        latest, committed = max(vs, default=None), vs.get(version)
        # The part digests of the version committed under that number (none in a plain version's manifest).
        existing = None if committed is None else {
            o: str(p.get("digest", "")) for o, p in json.loads(committed[1]).items() if isinstance(p, dict)}
        key = (model, version, json.dumps(owners))
        mine = {"digest": digest, "manifest": manifest, "groups": dict(groups or {})}
        parts = {**{o: json.loads(raw) for o, raw in self._pending.get(key, {}).items()}, owner: mine}
        decided, group = part_rule(version, owner, digest, existing, latest, owners,
                                   {o: p["groups"] for o, p in parts.items()})
        if decided == "exists":
            return CommitResult(created=False)
        if decided == "conflict":
            assert committed is not None
            raise conflict(model, version, committed[0], digest)
        if decided == "not_above":
            assert latest is not None
            raise not_above(model, version, latest)
        if decided == "pending":
            self._pending.setdefault(key, {})[owner] = json.dumps(mine)
            return None
        self._pending.pop(key, None)
        if decided == "diverged":
            raise diverged_error(model, version, group)
        combined = combined_digest(owners, {o: parts[o]["digest"] for o in owners})
        return await self.commit(model, version, combined, json.dumps({o: parts[o] for o in owners}), retain)

    async def withdraw_part(self, model: str, version: int, owner: str, owners: Sequence[str] = ()) -> bool:
        if version in self._manifests.get(model, {}):
            return False
        key = (model, version, json.dumps(sorted(owners)))
        pending = self._pending.get(key, {})
        pending.pop(owner, None)
        if not pending:
            self._pending.pop(key, None)
        return True

    async def part_pending(self, model: str, version: int, owner: str, owners: Sequence[str]) -> bool:
        return owner in self._pending.get((model, version, json.dumps(sorted(owners))), {})

    async def versions(self, model: str) -> list[int]:
        return sorted(self._manifests.get(model, {}))

    async def manifest(self, model: str, version: int) -> str | None:
        entry = self._manifests.get(model, {}).get(version)
        return entry[1] if entry else None

    async def models(self) -> list[str]:
        return sorted(m for m, vs in self._manifests.items() if vs)

    async def events(self, model: str, after: int) -> AsyncIterator[int]:
        last = after
        while True:
            async with self._changed:
                await self._changed.wait_for(functools.partial(self._has_above, model, last))
                newer = sorted(v for v in self._manifests[model] if v > last)
            for v in newer:
                yield v
                last = v

    def _has_above(self, model: str, version: int) -> bool:
        return any(v > version for v in self._manifests.get(model, {}))

    async def ack(self, model: str, client_id: str, version: int, unix: float, caller: str, keep_s: float) -> bool:
        acks = self._acks.setdefault(model, {})
        held = acks.pop(client_id, None)  # (re-inserted: the oldest ack comes first)
        if held is not None and held[2] != caller and held[1] >= unix - keep_s:
            acks[client_id] = held
            return False
        acks[client_id] = (version, unix, caller)
        # The oldest go: past the bound, or silent for `keep_s` (this one's own ack ends the loop).
        while len(acks) > ACKS_KEPT or next(iter(acks.values()))[1] < unix - keep_s:
            del acks[next(iter(acks))]
        return True

    async def acks(self, model: str) -> dict[str, tuple[int, float]]:
        return {c: (v, t) for c, (v, t, _) in self._acks.get(model, {}).items()}

    async def add_mismatch(self, model: str, added: Mapping[int, MismatchRecord], keep: Sequence[int]
                           ) -> dict[int, MismatchRecord]:
        kept = set(keep)
        records = {v: r for v, r in self._mismatch.get(model, {}).items() if v in kept}
        conflicts = {v: (records[v].band, r.band) for v, r in added.items()
                     if v in records and records[v].band != r.band}
        if conflicts:
            raise band_conflict(model, conflicts)
        totals = {v: records[v].plus(r) if v in records else r for v, r in added.items()}
        if overflown := [v for v, total in totals.items() if not total.fits()]:
            raise totals_overflow(model, overflown)
        self._mismatch[model] = records | totals
        return totals

    async def mismatch(self, model: str) -> dict[int, MismatchRecord]:
        return dict(self._mismatch.get(model, {}))

    async def register(self, replica: Replica, ttl: float = REPLICA_TTL_S) -> bool:
        renewed = replica.id in self._replicas
        self._replicas[replica.id] = replica
        return renewed

    async def deregister(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    async def replicas(self) -> list[Replica]:
        return sorted(self._replicas.values())

    async def close(self) -> None:
        pass


def _retain(versions: dict[int, Any], retain: int) -> tuple[int, ...]:
    """Drop all but the newest `retain` versions; the ones dropped, oldest first."""
    evicted = tuple(sorted(versions)[: max(0, len(versions) - retain)])
    for v in evicted:
        del versions[v]
    return evicted
