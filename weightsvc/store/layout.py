"""The objects of a version in the store, and its commit marker.

    PREFIX/versions/MODEL/VERSION.safetensors   a full version: the safetensors file a replica serves
    PREFIX/versions/MODEL/VERSION.delta         a delta version: its data section encoded as changes
                                                from version `base` (`protocol.delta`)
    PREFIX/versions/MODEL/VERSION.json          the commit marker, written last: the manifest (every
                                                tensor's checksum), which object holds the version,
                                                its size and checksum, and the delta's base

VERSION is the step, 20 digits, so names sort as numbers. A version exists in the store once its
marker does: an upload cut short, or one whose marker was never written, is not a version.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsvc.errors import DataLoss, subject
from weightsvc.protocol import delta
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.refs import MAX_STEP

FULL, DELTA = "full", "delta"
VERSIONS = "versions/"
MARKER_SUFFIX = ".json"
VERSION_DIGITS = 20


def model_folder(model: str) -> str:
    return f"{VERSIONS}{model}/"


def marker_name(model: str, version: int) -> str:
    return f"{model_folder(model)}{version:020d}{MARKER_SUFFIX}"


def object_name(model: str, version: int, kind: str) -> str:
    return f"{model_folder(model)}{version:020d}." + ("safetensors" if kind == FULL else "delta")


def version_of(model: str, name: str) -> int | None:
    """The version whose marker `name` is (None: another object, whatever digits it holds: a marker's
    name has the 20 that `marker_name` writes)."""
    stem = name.removeprefix(model_folder(model)).removesuffix(MARKER_SUFFIX)
    if len(stem) != VERSION_DIGITS or not (stem.isascii() and stem.isdigit()) or not name.endswith(MARKER_SUFFIX):
        return None
    return int(stem)


@dataclass(frozen=True)
class Marker:
    """A version's commit marker."""

    manifest: Manifest
    kind: str  # FULL or DELTA
    base: int | None  # DELTA: the version the delta is on
    chain: int  # deltas since the last full version (0: this is one)
    nbytes: int  # of the object
    checksum: str  # of the object's bytes
    data_start: int = 0  # FULL: where the data section starts in the object (after the header)

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def object(self) -> str:
        return object_name(self.manifest.model, self.manifest.version, self.kind)

    def to_json(self) -> bytes:
        return json.dumps({"kind": self.kind, "base": self.base, "chain": self.chain, "bytes": self.nbytes,
                           "checksum": self.checksum, "data_start": self.data_start,
                           "manifest": json.loads(self.manifest.json())}).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview, model: str, version: int) -> Marker:
        """A marker read from the store, checked to be one of `version` of `model` (its manifest is
        checked by whoever allocates for it: `Limits.check`)."""
        where = f"{subject(model, version)}: the store's commit marker"
        try:
            d = json.loads(bytes(raw))
            m = Manifest.from_dict(d["manifest"])
            marker = cls(m, d["kind"], d["base"], d["chain"], d["bytes"], d["checksum"], d.get("data_start", 0))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise DataLoss(f"{where} is not one weightsvc writes: {type(e).__name__}: {e}") from None
        sizes = (marker.chain, marker.nbytes, marker.data_start)
        if (m.model, m.version) != (model, version) or marker.kind not in (FULL, DELTA) or any(
                type(n) is not int or n < 0 for n in sizes) or (marker.kind == DELTA) != (type(marker.base) is int):
            raise DataLoss(f"{where} is not one weightsvc writes (it says {subject(m.model, m.version)}, "
                           f"a {marker.kind!r} version on {marker.base!r})")
        # Versions only go up, so a delta is on an earlier one: a chain of them always ends (one that
        # loops, a marker on itself or two on each other, is damaged).
        if marker.kind == DELTA and not (marker.base is not None and 0 <= marker.base < version and marker.chain > 0):
            raise DataLoss(f"{where} is damaged: it says its delta is on version {marker.base}, {marker.chain} "
                           "deltas after a full version; a delta is on an earlier version, one or more after it")
        if marker.kind == FULL and marker.chain != 0:
            raise DataLoss(f"{where} is damaged: it says a full version is {marker.chain} deltas after one")
        if version > MAX_STEP or type(m.data_bytes) is not int or type(m.tensors) is not tuple:
            raise DataLoss(f"{where} is not one weightsvc writes (versions are steps in [0, {MAX_STEP}], with a "
                           "data section of a whole number of bytes)")
        # The object's size follows from the manifest: nothing larger is read for it.
        if marker.kind == FULL and not (marker.data_start >= 8 and marker.nbytes == marker.data_start + m.data_bytes):
            raise DataLoss(f"{where} is damaged: a full version of {marker.nbytes} bytes, its header "
                           f"{marker.data_start} of them, and a data section of {m.data_bytes}")
        if marker.kind == DELTA and not (marker.data_start == 0 and marker.nbytes <= delta.most_bytes(m)):
            raise DataLoss(f"{where} is damaged: a delta of {marker.nbytes} bytes, more than one of a data section "
                           f"of {m.data_bytes} bytes in {len(m.tensors)} tensors takes")
        return marker

    def info(self) -> dict[str, Any]:
        return self.manifest.info()


@dataclass(frozen=True)
class Damaged:
    """What a store holds that is no version it can serve: a commit marker, or a model's folder (`name`,
    relative to the store's prefix), and why."""

    model: str
    name: str
    reason: str


def chain(marker: Marker, lookup: Callable[[int], Marker | None]) -> list[Marker]:
    """The markers a version is built from: its full version first, itself last (`lookup`: the marker
    of a version of the same model, None if the store has none). Each marker says how many deltas it
    is after a full version, one more than its base says: the walk takes `marker.chain` steps at most."""
    m = marker.manifest
    out = [marker]
    while (on := out[-1].base) is not None:
        step = out[-1]
        base = lookup(on)
        if base is None:
            raise DataLoss(f"{subject(m.model, m.version)}: the store lost version {on}, which "
                           "its delta is built on")
        if base.chain != step.chain - 1:
            raise DataLoss(f"{subject(m.model, m.version)}: the store's delta chain is damaged: the marker of version "
                           f"{step.version} says it is {step.chain} deltas after a full version, that of version "
                           f"{base.version}, which it is on, {base.chain}")
        out.append(base)
    return out[::-1]
