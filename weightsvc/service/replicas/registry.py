"""The registry: which versions of which model are committed, their manifests, version events and
client acks. Payload bytes never go through it; they stay with the server that holds them.

`Registry` is the contract; `MemoryRegistry` (memory.py) is the embedded default (one process) and
`RedisRegistry` (redis.py, `--redis-url`) shares the same state between replicas. Both follow it
(tests/integration/test_registry.py runs the same tests on each), and both apply the rules here.

The commit rule is stated once, here (`commit_rule`, `part_rule`): the embedded registry and the
committer apply it; Redis runs it as Lua (redis.py), held to these functions by
tests/integration/test_commit_rule.py. Retention keeps the newest `retain` versions.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from weightsvc.errors import AlreadyExists, DataLoss, FailedPrecondition, subject
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.mismatch import DEFAULT_BAND, MAX_TOKENS, Band, RolloutMismatch, bounded_mean
from weightsvc.protocol.parts import combine_parts
from weightsvc.protocol.topology import REPLICA_TTL_S, Replica

EVENTS_KEPT = 1000  # per model: a watcher further behind than this starts from the retained versions
PART_TTL_S = 600.0  # parts of a version whose other parts never come are dropped after this
ACKS_KEPT = 10_000  # clients' acks kept per model (by this server, and by the registry)


@dataclass(frozen=True)
class CommitResult:
    created: bool  # False: the same step with the same digest was already committed
    evicted: tuple[int, ...] = ()  # versions retention dropped


@dataclass(frozen=True)
class MismatchRecord:
    """A version's reported mismatch as sums over its tokens (reports add up exactly, in any order),
    and the learner step of the latest report that gave one."""

    tokens: int
    abs_logp_delta: float  # the sum over tokens of |log r|
    k3_kl: float  # of r - 1 - log r
    outside_band: float  # the tokens whose r lies outside the band
    step: int | None = None
    band: Band = DEFAULT_BAND  # the IcePop band of every report of the version

    @staticmethod
    def of(m: RolloutMismatch, step: int | None) -> MismatchRecord:
        n = m.tokens
        return MismatchRecord(n, m.mean_abs_logp_delta * n, m.k3_kl * n, m.outside_band * n, step, m.band)

    def plus(self, other: MismatchRecord) -> MismatchRecord:
        return MismatchRecord(self.tokens + other.tokens, self.abs_logp_delta + other.abs_logp_delta,
                              self.k3_kl + other.k3_kl, self.outside_band + other.outside_band,
                              self.step if other.step is None else other.step, self.band)

    def mismatch(self) -> RolloutMismatch:
        n = self.tokens
        sums = {"mean_abs_logp_delta": self.abs_logp_delta, "k3_kl": self.k3_kl, "outside_band": self.outside_band}
        return RolloutMismatch(n, **{f: bounded_mean(f, total / n) for f, total in sums.items()}, band=self.band)

    def fits(self) -> bool:
        """Whether these totals still read as a `RolloutMismatch`: at most MAX_TOKENS tokens, finite sums."""
        return 0 < self.tokens <= MAX_TOKENS and all(
            math.isfinite(s) and s >= 0 for s in (self.abs_logp_delta, self.k3_kl, self.outside_band))


def band_conflict(model: str, conflicts: Mapping[int, tuple[Band, Band]]) -> FailedPrecondition:
    """The error of a report whose band differs from the one its versions were reported with."""
    which = "; ".join(f"version {v}: reported with {list(had)}, this report {list(new)}"
                      for v, (had, new) in sorted(conflicts.items()))
    return FailedPrecondition(f"model {model!r}: the report's IcePop band differs from the version's ({which}): "
                              "outside_band shares of different bands do not add up; nothing of this report was "
                              "recorded")


def totals_overflow(model: str, versions: Sequence[int]) -> FailedPrecondition:
    """The error of a report that would take versions' totals past what a record holds (`MismatchRecord.fits`):
    refused whole, so that every version's totals stay listable."""
    return FailedPrecondition(f"model {model!r}: the report would take the mismatch totals of version(s) "
                              f"{sorted(versions)} past {MAX_TOKENS} tokens or past a finite sum; nothing of this "
                              "report was recorded")


def commit_rule(version: int, digest: str, existing: str | None, latest: int | None) -> str:
    """The commit rule of a version, given the digest the registry holds under its number (if any)
    and the model's latest version: "exists" (the same content again: an idempotent success),
    "conflict" (other content under that number), "not_above" (a step below the latest; steps only
    go up), else "created"."""
    if existing is not None:
        return "exists" if existing == digest else "conflict"
    if latest is not None and version < latest:
        return "not_above"
    return "created"


def part_rule(version: int, owner: str, digest: str, existing: Mapping[str, str] | None, latest: int | None,
              owners: Sequence[str], pending: Mapping[str, Mapping[str, str]]) -> tuple[str, str]:
    """The commit rule of `owner`'s part of a version made of the parts of `owners`, and the group it
    names (for "diverged"). `existing`: the part digests by owner of the version committed under that
    number (empty for a version not made of parts), None if none is; `pending`: the digests of the
    groups of tensors of each owner's part recorded so far, this part's included.
    As `commit_rule` for the part ("exists" when the committed version holds this very part); then
    "pending" until every owner's part is in, "diverged" when the owners of a group of tensors hold
    different bytes of it, else "created" (the version, of the parts' combined digest)."""
    if existing is not None:
        return ("exists" if existing.get(owner) == digest else "conflict"), ""
    if latest is not None and version < latest:
        return "not_above", ""
    if any(o not in pending for o in owners):
        return "pending", ""
    seen: dict[str, str] = {}
    for o in sorted(owners):
        for group, group_digest in pending[o].items():
            if seen.setdefault(group, group_digest) != group_digest:
                return "diverged", group
    return "created", ""


def check_commit(model: str, version: int, digest: str, existing: str | None, latest: int | None) -> bool:
    """`commit_rule` applied: True to commit, False for an idempotent re-push; raises otherwise."""
    decided = commit_rule(version, digest, existing, latest)
    if decided == "conflict":
        assert existing is not None
        raise conflict(model, version, existing, digest)
    if decided == "not_above":
        assert latest is not None
        raise not_above(model, version, latest)
    return decided == "created"


def combined_digest(owners: Sequence[str], digests: Mapping[str, str]) -> str:
    """The digest of a version made of parts: over each owner's part digest, in owner order."""
    return "sha1:" + hashlib.sha1("\n".join(f"{o}:{digests[o]}" for o in owners).encode()).hexdigest()


def record_digest(raw: str) -> str:
    """The master digest the registry records with a version (as `manifest_from_registry` reads it):
    a plain manifest's own, or for a version made of parts, the one combined from its parts'."""
    try:
        d = json.loads(raw)
        if "model" in d:
            return str(d["master_digest"])
        owners = sorted(d)
        return combined_digest(owners, {o: d[o]["digest"] for o in owners})
    except (ValueError, KeyError, TypeError) as e:
        raise DataLoss(f"the registry's record holds no readable digest ({e})") from None


def manifest_from_registry(raw: str, where: str) -> Manifest:
    """A committed version's manifest as the registry records it: a manifest, or for a version made
    of parts, each owner's part (digest and manifest), combined here."""
    try:
        d = json.loads(raw)
        if "model" in d:
            return Manifest.from_dict(d)
        parts = {owner: Manifest.from_dict(json.loads(p["manifest"])) for owner, p in d.items()}
        owners = sorted(parts)
        return combine_parts(parts, combined_digest(owners, {o: d[o]["digest"] for o in owners}))
    except (ValueError, KeyError, TypeError) as e:
        raise DataLoss(f"{where}: the registry holds no readable manifest ({e})") from None


def diverged_error(model: str, version: int, group: str) -> DataLoss:
    return DataLoss(
        f"{subject(model, version)}: the owners {group.split(',')} of a group of tensors exported "
        "different bytes for it; nothing was committed"
    )


def conflict(model: str, version: int, existing: str, pushed: str) -> AlreadyExists:
    return AlreadyExists(
        f"{subject(model, version)} is already committed with different content "
        f"(master digest {existing}, pushed {pushed})",
        reason="content_conflict",
    )


def not_above(model: str, version: int, latest: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"model {model!r}: step {version} is not above the latest version {latest}", reason="step_not_above_latest"
    )


class Registry(Protocol):
    async def commit(self, model: str, version: int, digest: str, manifest: str, retain: int) -> CommitResult:
        """Commit a version under the commit rules; retention applies."""
        ...

    async def restore(self, model: str, version: int, digest: str, manifest: str, retain: int) -> bool:
        """Take back a version a server holds durably and the registry has lost (its data, not its
        verdict): added whatever the latest is, with no event; retention applies. True if it is
        now held (already, or restored), False if retention left it out. ALREADY_EXISTS if the
        registry holds that version with another digest."""
        ...

    async def commit_part(
        self, model: str, version: int, owner: str, owners: Sequence[str], digest: str, manifest: str, retain: int,
        groups: Mapping[str, str] | None = None,
    ) -> CommitResult | None:
        """Record `owner`'s part of a version made of the parts of `owners`; the last part commits the
        version (its manifest: the parts by owner). None: recorded, other parts still missing.
        `groups`: with replication, the digest of each group of tensors the part holds (by its owners):
        the owners of a group must hold the same bytes, or nothing commits (DATA_LOSS). Parts gather
        per set of owners, so a push tried again without an owner that went down starts afresh."""
        ...

    async def withdraw_part(self, model: str, version: int, owner: str, owners: Sequence[str] = ()) -> bool:
        """Take back a part of a version that never completed; False: too late, it committed."""
        ...

    async def part_pending(self, model: str, version: int, owner: str, owners: Sequence[str]) -> bool:
        """Whether `owner`'s part of a version of `owners` waits in the registry for the other parts
        (False once the version committed, and after the registry lost its data)."""
        ...

    async def versions(self, model: str) -> list[int]:
        """The retained versions of `model`, oldest first."""
        ...

    async def manifest(self, model: str, version: int) -> str | None:
        """A retained version's manifest as recorded (see `manifest_from_registry`), or None."""
        ...

    async def models(self) -> list[str]:
        """The models with a retained version."""
        ...

    def events(self, model: str, after: int) -> AsyncIterator[int]:
        """Each committed version above `after`, in order, as it commits (retained ones first)."""
        ...

    async def ack(self, model: str, client_id: str, version: int, unix: float, caller: str, keep_s: float) -> bool:
        """Record the version a client serves, unless its id belongs to another caller (False). The
        acks of `model` are kept for `keep_s` after the last, the newest `ACKS_KEPT` of them."""
        ...

    async def acks(self, model: str) -> dict[str, tuple[int, float]]:
        """Each client's last ack of `model`: (version, unix time)."""
        ...

    async def add_mismatch(self, model: str, added: Mapping[int, MismatchRecord], keep: Sequence[int]
                           ) -> dict[int, MismatchRecord]:
        """Add each version's record to what the version holds, all at once; the records of versions
        not in `keep` (the retained ones) go. Returns the added versions' totals. A record whose band
        is not its version's (`band_conflict`), or one that would take its version's totals past what a
        record holds (`totals_overflow`), raises FAILED_PRECONDITION: nothing is added, nothing goes."""
        ...

    async def mismatch(self, model: str) -> dict[int, MismatchRecord]:
        """Each version's record of `model`."""
        ...

    async def register(self, replica: Replica, ttl: float = REPLICA_TTL_S) -> bool:
        """Announce (or renew) a replica; it expires unless renewed within `ttl` seconds. True if it
        was registered already (a renewal); False if not: a first registration, or one the registry
        forgot (it expired, or the registry lost its data)."""
        ...

    async def deregister(self, replica_id: str) -> None:
        ...

    async def replicas(self) -> list[Replica]:
        """The live replicas."""
        ...

    async def close(self) -> None:
        ...
