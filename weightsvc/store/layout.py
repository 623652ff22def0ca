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
from weightsvc.protocol.manifest import Manifest

FULL, DELTA = "full", "delta"
VERSIONS = "versions/"
MARKER_SUFFIX = ".json"


def model_folder(model: str) -> str:
    return f"{VERSIONS}{model}/"


def marker_name(model: str, version: int) -> str:
    return f"{model_folder(model)}{version:020d}{MARKER_SUFFIX}"


def object_name(model: str, version: int, kind: str) -> str:
    return f"{model_folder(model)}{version:020d}." + ("safetensors" if kind == FULL else "delta")


def version_of(model: str, name: str) -> int | None:
    """The version whose marker `name` is (None: another object)."""
    stem = name.removeprefix(model_folder(model))
    if not stem.endswith(MARKER_SUFFIX) or not stem[: -len(MARKER_SUFFIX)].isdigit():
        return None
    return int(stem[: -len(MARKER_SUFFIX)])


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
        except (ValueError, KeyError, TypeError) as e:
            raise DataLoss(f"{where} is not one weightsvc writes: {type(e).__name__}: {e}") from None
        sizes = (marker.chain, marker.nbytes, marker.data_start)
        if (m.model, m.version) != (model, version) or marker.kind not in (FULL, DELTA) or any(
                type(n) is not int or n < 0 for n in sizes) or (marker.kind == DELTA) != (type(marker.base) is int):
            raise DataLoss(f"{where} is not one weightsvc writes (it says {subject(m.model, m.version)}, "
                           f"a {marker.kind!r} version on {marker.base!r})")
        return marker

    def info(self) -> dict[str, Any]:
        return self.manifest.info()


def chain(marker: Marker, lookup: Callable[[int], Marker | None]) -> list[Marker]:
    """The markers a version is built from: its full version first, itself last (`lookup`: the marker
    of a version of the same model, None if the store has none)."""
    out = [marker]
    while out[-1].base is not None:
        base = lookup(out[-1].base)
        if base is None:
            m = marker.manifest
            raise DataLoss(f"{subject(m.model, m.version)}: the store lost version {out[-1].base}, which "
                           "its delta is built on")
        out.append(base)
    return out[::-1]
