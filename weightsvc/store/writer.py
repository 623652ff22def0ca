"""Writing versions to the store: a full version or a delta on the one before it, its object first and
its commit marker last; and the store's retention, as the server's.

Blocking (uploads, hashing, delta encoding): the service runs these in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

from weightsvc.errors import AlreadyExists, subject
from weightsvc.protocol import delta
from weightsvc.protocol.digest import CHECKSUM_PREFIX
from weightsvc.protocol.manifest import Manifest
from weightsvc.store.layout import DELTA, FULL, Marker, marker_name
from weightsvc.store.s3 import Bucket


@dataclass
class StoredModel:
    """What the store holds of one model: the sound marker of each version, by version
    (`StoreReader.markers`)."""

    markers: dict[int, Marker] = field(default_factory=dict)

    @property
    def latest(self) -> Marker | None:
        return self.markers[max(self.markers)] if self.markers else None


def object_checksum(*pieces: memoryview | bytes) -> str:
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return CHECKSUM_PREFIX + h.hexdigest()


def write_version(bucket: Bucket, manifest: Manifest, header: bytes, data: memoryview,
                  base: tuple[Marker, memoryview] | None) -> Marker:
    """Upload a version: as a delta on `base` (its marker and data section; same layout) when given,
    else whole; then its marker. Returns the marker."""
    if base is not None:
        encoded = delta.encode(manifest, data, base[1])
        marker = Marker(manifest, DELTA, base[0].version, base[0].chain + 1, len(encoded), object_checksum(encoded))
        bucket.put(marker.object, encoded)
    else:
        marker = Marker(manifest, FULL, None, 0, len(header) + len(data), object_checksum(header, data), len(header))
        bucket.put(marker.object, header, data)
    bucket.put(marker_name(manifest.model, manifest.version), marker.to_json())  # last: now it is a version
    return marker


def check_new(stored: StoredModel, manifest: Manifest) -> bool:
    """Whether `manifest`'s version is still to be written: False if the store holds it already (the
    same masters); ALREADY_EXISTS if it holds other content under its number."""
    held = stored.markers.get(manifest.version)
    if held is None:
        return True
    if held.manifest.master_digest != manifest.master_digest:
        raise AlreadyExists(f"{subject(manifest.model, manifest.version)}: the object store holds other "
                            "content under this version (another deployment writing to the same prefix?)")
    return False


def expired(stored: StoredModel, retain: int) -> list[int]:
    """The versions retention removes from the store: all but the newest `retain` and the delta chains
    they are built on (back to a full version)."""
    kept: set[int] = set()
    for version in sorted(stored.markers)[-retain:]:
        at: int | None = version
        while at is not None and at not in kept and at in stored.markers:
            kept.add(at)
            at = stored.markers[at].base
    return sorted(set(stored.markers) - kept)


def remove(bucket: Bucket, stored: StoredModel, versions: list[int]) -> None:
    """Remove versions from the store: each marker first (the version is gone), then its object."""
    for version in versions:
        marker = stored.markers.pop(version)
        bucket.delete(marker_name(marker.manifest.model, version))
        bucket.delete(marker.object)
