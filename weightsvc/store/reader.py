"""Reading versions from the store alone, without a weightsvc server: the models and versions it
holds, a version rebuilt from its full version and the deltas after it (or from a version held
already), and a selection of a version.

Nothing the store holds is trusted: each marker is checked (`Marker.from_json`; its manifest by the
caller's `check` before anything is allocated for it), each object against the size and checksum in
its marker before it is used, and the tensors of a selection against the manifest's checksums.
The caller verifies a whole version's tensors (`verify_data`).

Blocking: the clients call it from their own threads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from weightsvc.errors import DataLoss, NotFound, subject
from weightsvc.memory import alloc
from weightsvc.protocol import delta
from weightsvc.protocol.digest import verify
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.parts import Segment
from weightsvc.protocol.selection import Select, chosen, gather
from weightsvc.store.layout import FULL, VERSIONS, Marker, chain, marker_name, model_folder, version_of
from weightsvc.store.s3 import Bucket
from weightsvc.store.writer import object_checksum

Progress = Callable[[int], None]
Check = Callable[[Manifest], Manifest]  # a manifest from the store, checked before anything is allocated for it


class StoreReader:
    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self._markers: dict[tuple[str, int], Marker] = {}  # a version's marker never changes

    def models(self) -> list[str]:
        return self.bucket.folders(VERSIONS)

    def versions(self, model: str) -> list[int]:
        """The versions of `model` in the store, oldest first (NOT_FOUND: none)."""
        found = sorted(v for name in self.bucket.names(model_folder(model))
                       if (v := version_of(model, name)) is not None)
        if not found:
            raise NotFound(f"unknown model {model!r}: the object store {self.bucket.url} holds no version of it")
        return found

    def marker(self, model: str, version: int | None) -> Marker:
        """The marker of `version` of `model` (None: the latest)."""
        if version is None:
            version = self.versions(model)[-1]
        key = (model, version)
        if key not in self._markers:
            try:
                raw = self.bucket.get(marker_name(model, version))
            except NotFound:
                kept = ", ".join(map(str, self.versions(model)))
                raise NotFound(f"model {model!r} has no version {version} in the object store {self.bucket.url} "
                               f"(retained: {kept})") from None
            self._markers[key] = Marker.from_json(raw, model, version)
        return self._markers[key]

    def load(self, marker: Marker, held: tuple[Manifest, memoryview] | None, moved: Progress,
             check: Check) -> memoryview:
        """The data section of `marker`'s version: the deltas after `held` (a version of its chain) applied
        to a copy of it, or its full version with the deltas after it. Not yet verified."""
        m = marker.manifest
        steps = chain(marker, lambda v: self._lookup(m.model, v))
        for step in steps:
            check(step.manifest)
        at = next((i for i, s in enumerate(steps) if held is not None and s.version == held[0].version
                   and len(held[1]) == s.manifest.data_bytes), None)
        if at is not None and held is not None:
            data = alloc(len(held[1]))
            data[:] = held[1]
        else:
            at, full = 0, steps[0]
            whole = self._object(full, moved)
            data = whole[full.data_start :]
        for step in steps[at + 1 :]:
            patch = self._object(step, moved)
            if len(data) != step.manifest.data_bytes:
                raise DataLoss(f"{subject(m.model, step.version)}: a delta of a data section of "
                               f"{step.manifest.data_bytes} bytes on one of {len(data)}")
            try:
                delta.apply(step.manifest, patch, data)
            except (ValueError, IndexError) as e:
                raise DataLoss(f"{subject(m.model, step.version)}: bad delta in the object store: "
                               f"{e}") from None
        return data

    def selection(self, marker: Marker, select: Select, moved: Progress, check: Check) -> tuple[Manifest, memoryview]:
        """A selection of `marker`'s version: of a full version, the selected tensors' bytes alone
        (whole, so each is verified against its checksum before it is sliced); of a delta version, the
        version rebuilt first."""
        m = marker.manifest
        where = f"{subject(m.model, m.version)} (object store)"
        picked = [t for t, _ in chosen(m, select)]
        if marker.kind == FULL:
            # Tensors that follow each other in the data section are read as one range: one GET each.
            spans: list[Segment] = []
            at = 0
            for t in picked:
                last = spans[-1] if spans else None
                if last is not None and last.start + last.nbytes == t.offset and last.local + last.nbytes == at:
                    spans[-1] = Segment(last.start, last.local, last.nbytes + t.nbytes)
                else:
                    spans.append(Segment(t.offset, at, t.nbytes))
                at += t.nbytes
            held = alloc(at)
            for span in spans:
                if span.nbytes:  # (tensors of no elements have no range to read)
                    start = marker.data_start + span.start
                    self.bucket.get(marker.object, (start, start + span.nbytes),
                                    held[span.local : span.local + span.nbytes])
                    moved(span.nbytes)
            local: Iterable[int] = itertools.accumulate((t.nbytes for t in picked), initial=0)
        else:
            held = self.load(marker, None, moved, check)
            spans = [Segment(0, 0, len(held))]
            local = (t.offset for t in picked)
        for t, at in zip(picked, local, strict=False):
            verify(t.name, held[at : at + t.nbytes], t.checksum, where=where)
        selected = gather(m, held, spans, select)
        data = alloc(selected.manifest.data_bytes)
        for t, segment in zip(selected.manifest.tensors, selected.segments, strict=True):
            data[t.offset : t.offset + t.nbytes] = segment
        return selected.manifest, data

    def _lookup(self, model: str, version: int) -> Marker | None:
        try:
            return self.marker(model, version)
        except NotFound:
            return None

    def _object(self, marker: Marker, moved: Progress) -> memoryview:
        """The object of `marker`'s version, checked against its size and checksum."""
        m = marker.manifest
        raw = self.bucket.get(marker.object)
        moved(len(raw))
        if len(raw) != marker.nbytes or object_checksum(raw) != marker.checksum:
            raise DataLoss(f"{subject(m.model, m.version)}: object {marker.object!r} of the object store "
                           f"{self.bucket.url} is {len(raw)} bytes with checksum {object_checksum(raw)}; its "
                           f"commit marker says {marker.nbytes} bytes, {marker.checksum}")
        return raw
