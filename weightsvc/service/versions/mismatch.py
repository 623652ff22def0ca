"""The trainer-rollout mismatch learners report, per model and version: checked, added up token-weighted
in the registry, shown in the version listing and the metrics.

Records live in the registry, not in a replica: a learner reports to whichever replica it reaches,
and any replica lists the same totals (with Redis, every replica's). They follow retention: a report
names retained versions only, and a version's record goes when the version does.

Loop-owned: every method runs on the service's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsvc.errors import InvalidArgument, NotFound, subject
from weightsvc.metrics import Metrics
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.mismatch import MEANS, RolloutMismatch
from weightsvc.protocol.refs import MAX_STEP
from weightsvc.service.replicas.registry import MismatchRecord, Registry
from weightsvc.service.versions.index import VersionIndex

log = logging.getLogger("weightsvc.mismatch")
MAX_REPORTED_VERSIONS = 1024  # versions one report may name (a batch spans a few)


@dataclass(frozen=True)
class Reported:
    """A version's mismatch over every report so far, and the learner step of the latest report."""

    mismatch: RolloutMismatch
    step: int | None


def _version(model: str, key: object) -> int:
    """A report's version: gRPC's key is an int64, HTTP's the text of a JSON object's key."""
    text = str(key)
    if isinstance(key, int) and not isinstance(key, bool):
        version = key
    else:
        if not (text.isascii() and text.isdigit()):
            raise InvalidArgument(f"model {model!r}: version {text[:40]!r} is not a version number")
        # (a number of more digits than any version is not read: Python refuses ints of 4,300 digits)
        version = int(text) if len(text.lstrip("0")) <= len(str(MAX_STEP)) else MAX_STEP + 1
    if not 0 <= version <= MAX_STEP:
        shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"
        raise InvalidArgument(f"model {model!r}: version {shown} is outside [0, {MAX_STEP}]")
    return version


def _mismatch(model: str, version: int, fields: Mapping[str, Any]) -> RolloutMismatch:
    missing = [f for f in ("tokens", *MEANS) if f not in fields]
    extra = sorted(set(fields) - {"tokens", *MEANS, "band"})  # (no band: the default one)
    if missing or extra:
        raise InvalidArgument(f"{subject(model, version)}: "
                              + (f"missing {missing}" if missing else f"unknown fields {extra}"))
    try:
        return RolloutMismatch(**fields)
    except ValueError as e:
        raise InvalidArgument(f"{subject(model, version)}: {e}; nothing of this report was recorded") from None


class Mismatches:
    def __init__(self, index: VersionIndex, registry: Registry, metrics: Metrics) -> None:
        self._index = index
        self._registry = registry
        self._metrics = metrics

    def parse(self, model: str, versions: Mapping[Any, Mapping[str, Any]]) -> dict[int, RolloutMismatch]:
        """A report's versions, each checked (INVALID_ARGUMENT names the version and the field)."""
        if not versions:
            raise InvalidArgument(f"model {model!r}: the report names no version")
        if len(versions) > MAX_REPORTED_VERSIONS:
            raise InvalidArgument(f"model {model!r}: the report names {len(versions)} versions, more than "
                                  f"{MAX_REPORTED_VERSIONS}")
        out: dict[int, RolloutMismatch] = {}
        for key, fields in versions.items():
            version = _version(model, key)
            if version in out:
                raise InvalidArgument(f"model {model!r}: version {version} is named twice in the report")
            out[version] = _mismatch(model, version, fields)
        return out

    async def report(self, model: str, versions: Mapping[Any, Mapping[str, Any]], step: int | None
                     ) -> dict[int, RolloutMismatch]:
        """Add a report to the records: every version of it, or (on any error) none. Returns each
        reported version's totals after it."""
        by_version = self.parse(model, versions)
        if step is not None and not 0 <= step <= MAX_STEP:
            raise InvalidArgument(f"model {model!r}: step {step} is outside [0, {MAX_STEP}]")
        retained = self._retained(model)
        gone = sorted(set(by_version) - set(retained))
        if gone:
            raise NotFound(f"model {model!r}: version(s) {gone} not retained (retired, or never committed; retained: "
                           f"{sorted(retained)}); nothing of this report was recorded")
        added = {v: MismatchRecord.of(m, step) for v, m in by_version.items()}
        totals = await self._registry.add_mismatch(model, added, sorted(retained))
        latest = max(by_version)
        self._metrics.observe_mismatch(
            model, [(retained[v].format, retained[v].rounding, m) for v, m in by_version.items()],
            (retained[latest].format, retained[latest].rounding, totals[latest].mismatch()))
        return {v: totals[v].mismatch() for v in by_version}

    async def listing(self, model: str) -> dict[int, Reported]:
        """The records of `model`'s retained versions (NOT_FOUND for an unknown model)."""
        retained = self._retained(model)
        records = await self._registry.mismatch(model)
        listed = {}
        for v, r in records.items():
            if v not in retained:
                continue
            if not r.fits():  # (recorded before the registry refused such totals: left out, not a failed listing)
                log.warning("%s: mismatch totals past what a record holds (%d tokens); not listed",
                            subject(model, v), r.tokens)
                continue
            listed[v] = Reported(r.mismatch(), r.step)
        return listed

    def _retained(self, model: str) -> dict[int, Manifest]:
        return {v.manifest.version: v.manifest for v in self._index.versions(model)}
