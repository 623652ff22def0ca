"""Reading versions from the store alone, without a weightsvc server: the models and versions it
holds, a version rebuilt from its full version and the deltas after it (or from a version held
already), and a selection of a version.

Nothing the store holds is trusted: each marker is checked (`Marker.from_json`; its manifest by the
caller's `check` before anything is allocated for it), each object against the size and checksum in
its marker before it is used, a full version's marker against the object's own header (what the
object's checksum covers: the marker alone could rename, retype or reshape a tensor whose bytes still
match its checksum), each delta's tensors against the layout of the version it is applied to, and
the tensors of a selection against the manifest's checksums. The caller verifies a whole version's
tensors (`verify_data`). What is damaged is no version: listings and `latest` pass over it, and
`damaged` says what it was.

Blocking: the clients call it from their own threads.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
from collections.abc import Callable, Iterable
from itertools import zip_longest

from weightsvc.errors import DataLoss, InvalidArgument, NotFound, subject
from weightsvc.memory import alloc
from weightsvc.protocol import delta
from weightsvc.protocol.digest import verify
from weightsvc.protocol.manifest import Manifest, ServedTensor, manifest_from_header
from weightsvc.protocol.parts import Segment
from weightsvc.protocol.refs import check_model_name
from weightsvc.protocol.safetensors import MAX_HEADER_BYTES, read_safetensors_header
from weightsvc.protocol.selection import Select, chosen, gather
from weightsvc.store.layout import (
    FULL,
    VERSIONS,
    Damaged,
    Marker,
    chain,
    marker_name,
    model_folder,
    version_of,
)
from weightsvc.store.s3 import Bucket
from weightsvc.store.writer import object_checksum

OWN_HEADER = "the object's own header says"
Progress = Callable[[int], None]
Check = Callable[[Manifest], Manifest]  # a manifest from the store, checked before anything is allocated for it


class StoreReader:
    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        # What was read of each version (model, version): its marker never changes, its object is
        # written before it, and retention deletes the marker first; a listing forgets what it no
        # longer holds.
        self._markers: dict[tuple[str, int], Marker] = {}
        self._damaged: dict[tuple[str, int], str] = {}  # why a version is no version
        self._in_place: set[tuple[str, int]] = set()  # versions whose object is there at its size
        self._lock = threading.Lock()  # (a client's watch and pulls read from threads of their own)

    def models(self) -> list[str]:
        """The models the store holds a folder of, with a name a model can have (`damaged` names the rest)."""
        return [model for model in self.bucket.folders(VERSIONS) if _model_name(model)]

    def versions(self, model: str) -> list[int]:
        """The versions of `model` in the store, oldest first: those that can be built, their chain's
        markers sound and objects in place at their size (NOT_FOUND: none). The rest are damaged
        (`damaged`): listings and `latest` pass over them."""
        found = [v for v in self._listed(model) if self._buildable(model, v)]
        if not found:
            aside = "".join(f"; {d.name} is damaged: {d.reason}" for d in self._damaged_of(model))
            raise NotFound(f"unknown model {model!r}: the object store {self.bucket.url} holds no version of it{aside}")
        return found

    def markers(self, model: str) -> dict[int, Marker]:
        """The markers of `model`'s versions (`versions`), by version."""
        try:
            return {v: self._read(model, v) for v in self.versions(model)}
        except NotFound:
            return {}

    def marker(self, model: str, version: int | None) -> Marker:
        """The marker of `version` of `model` (None: the latest)."""
        if version is None:
            version = self.versions(model)[-1]
        try:
            return self._read(model, version)
        except NotFound:
            kept = ", ".join(map(str, self.versions(model)))
            raise NotFound(f"model {model!r} has no version {version} in the object store {self.bucket.url} "
                           f"(retained: {kept})") from None

    def damaged(self, models: Iterable[str] | None = None) -> list[Damaged]:
        """What the store holds of `models` (None: every folder) that is no version: a folder no model
        can be named after, and each damaged version (by its commit marker)."""
        out = []
        for model in self.bucket.folders(VERSIONS) if models is None else models:
            if not _model_name(model):
                out.append(Damaged(model, model_folder(model), "no model can have this name"))
                continue
            with contextlib.suppress(NotFound):
                self.versions(model)
            out += self._damaged_of(model)
        return out

    def wrote(self, marker: Marker) -> None:
        """`marker` was just written, its object first (over a damaged version of its number, it may be)."""
        key = (marker.manifest.model, marker.version)
        with self._lock:
            self._damaged.pop(key, None)
            self._markers[key] = marker
            self._in_place.add(key)

    def _listed(self, model: str) -> list[int]:
        """The versions whose marker the store lists, whatever they hold; what it no longer lists is forgotten."""
        listed = {v for name in self.bucket.names(model_folder(model)) if (v := version_of(model, name)) is not None}
        with self._lock:
            for known in (self._markers, self._damaged):
                for key in [k for k in known if k[0] == model and k[1] not in listed]:
                    del known[key]
            self._in_place -= {k for k in self._in_place if k[0] == model and k[1] not in listed}
        return sorted(listed)

    def _buildable(self, model: str, version: int) -> bool:
        """Whether a version can be built: the markers of its chain sound, their objects in place at
        their size. One that cannot is damaged from now on."""
        try:
            for step in chain(self._read(model, version), lambda v: self._lookup(model, v)):
                self._check_in_place(step)
        except NotFound:
            return False  # removed since the listing (by the store's retention)
        except DataLoss as e:
            with self._lock:
                self._markers.pop((model, version), None)
                self._damaged[(model, version)] = e.message
            return False
        return True

    def _check_in_place(self, marker: Marker) -> None:
        m = marker.manifest
        key = (m.model, m.version)
        with self._lock:
            if key in self._in_place:
                return
        try:
            size: int | None = self.bucket.size(marker.object)
        except NotFound:
            size = None
        if size != marker.nbytes:
            raise DataLoss(f"{subject(m.model, m.version)}: object {marker.object!r} of the object store "
                           f"{self.bucket.url} is {'missing' if size is None else f'{size} bytes'}; its commit "
                           f"marker says {marker.nbytes} bytes")
        with self._lock:
            self._in_place.add(key)

    def _damaged_of(self, model: str) -> list[Damaged]:
        with self._lock:
            return [Damaged(model, marker_name(model, v), why) for (m, v), why in sorted(self._damaged.items())
                    if m == model]

    def _read(self, model: str, version: int) -> Marker:
        key = (model, version)
        with self._lock:
            why = self._damaged.get(key)
            if why is None and key in self._markers:
                return self._markers[key]
        if why is not None:
            raise DataLoss(why)
        try:
            raw = self.bucket.get(marker_name(model, version), max_bytes=MAX_HEADER_BYTES)
            marker = Marker.from_json(raw, model, version)
        except DataLoss as e:
            with self._lock:
                self._damaged[key] = e.message
            raise
        with self._lock:
            self._markers[key] = marker
        return marker

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
            layout = held[0]
        else:
            at, full = 0, steps[0]
            whole = self._object(full, moved)
            data = whole[full.data_start :]
            layout = full.manifest  # (what its object's header says: `_object` checked)
        for step in steps[at + 1 :]:
            same_layout(step.manifest, layout)
            patch = self._object(step, moved)
            try:
                delta.apply(step.manifest, patch, data)
            except (ValueError, IndexError, OverflowError, struct.error) as e:
                raise DataLoss(f"{subject(m.model, step.version)}: bad delta in the object store: "
                               f"{e}") from None
        return data

    def selection(self, marker: Marker, select: Select, moved: Progress, check: Check) -> tuple[Manifest, memoryview]:
        """A selection of `marker`'s version: of a full version, the selected tensors' bytes alone
        (whole, so each is verified against its checksum before it is sliced; the object's header read
        to check the marker against); of a delta version, the version rebuilt first."""
        m = check(marker.manifest)
        where = f"{subject(m.model, m.version)} (object store)"
        picked = [t for t, _ in chosen(m, select)]
        if marker.kind == FULL:
            check_header(marker, self.bucket.get(marker.object, (0, marker.data_start)) if marker.data_start else b"")
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
            return self._read(model, version)
        except NotFound:
            return None

    def _object(self, marker: Marker, moved: Progress) -> memoryview:
        """The object of `marker`'s version, checked against its size and checksum."""
        m = marker.manifest
        raw = self.bucket.get(marker.object, max_bytes=marker.nbytes)
        moved(len(raw))
        if len(raw) != marker.nbytes or object_checksum(raw) != marker.checksum:
            raise DataLoss(f"{subject(m.model, m.version)}: object {marker.object!r} of the object store "
                           f"{self.bucket.url} is {len(raw)} bytes with checksum {object_checksum(raw)}; its "
                           f"commit marker says {marker.nbytes} bytes, {marker.checksum}")
        if marker.kind == FULL:
            check_header(marker, raw[: marker.data_start])
        return raw


def check_header(marker: Marker, prefix: bytes | memoryview) -> None:
    """A full version's object starts with the header its manifest makes (what a replica serves): the
    marker's manifest must be that one. DATA_LOSS names the first tensor they differ on."""
    m = marker.manifest
    if bytes(prefix[8:]).rstrip(b" ") == m.safetensors_header()[8:].rstrip(b" "):
        return
    where = f"{subject(m.model, m.version)}: object {marker.object!r} of the object store"
    try:
        start, header = read_safetensors_header(prefix)
        own = manifest_from_header(header)
    except (InvalidArgument, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise DataLoss(f"{where} does not start with a header weightsvc writes (in the {len(prefix)} bytes its "
                       f"commit marker says it takes): {e}") from None
    if start != len(prefix):
        raise DataLoss(f"{where}: its header takes {start} bytes, its commit marker says {len(prefix)}")
    for said, truth in zip_longest(m.tensors, own.tensors):
        if said != truth:
            raise DataLoss(f"{where}: {_differ(said, truth, OWN_HEADER)}")
    said_fields, own_fields = m.to_dict(tensors=False), own.to_dict(tensors=False)
    fields = sorted(k for k in said_fields.keys() | own_fields.keys() if said_fields.get(k) != own_fields.get(k))
    raise DataLoss(f"{where}: the manifest of its commit marker differs from the one in the object's own header "
                   f"(in {', '.join(fields) if fields else 'the tensor entries of the header'})")


def same_layout(m: Manifest, layout: Manifest) -> None:
    """A delta of `m` is applied to a version laid out as `layout`: the same tensors, dtypes, shapes and
    places (`protocol.delta.compatible`), or DATA_LOSS naming the first tensor they differ on."""
    key = ("name", "dtype", "shape", "offset", "nbytes")
    for said, truth in zip_longest(m.tensors, layout.tensors):
        if said is None or truth is None or any(getattr(said, k) != getattr(truth, k) for k in key):
            raise DataLoss(f"{subject(m.model, m.version)}: "
                           f"{_differ(said, truth, f'version {layout.version}, which its delta is on, holds')}")
    if m.data_bytes != layout.data_bytes:
        raise DataLoss(f"{subject(m.model, m.version)}: a delta of a data section of {m.data_bytes} bytes on one of "
                       f"version {layout.version}, of {layout.data_bytes}")


def _differ(said: ServedTensor | None, truth: ServedTensor | None, other: str) -> str:
    """How the tensor a commit marker says and the one its object (or base) holds differ."""
    def described(t: ServedTensor | None) -> str:
        if t is None:
            return "no tensor"
        checksum = f", checksum {t.checksum}" if said and truth and said.checksum != truth.checksum else ""
        return f"tensor {t.name!r} {t.dtype} {list(t.shape)} at bytes [{t.offset}, +{t.nbytes}){checksum}"

    name = (truth or said).name  # type: ignore[union-attr]
    return f"tensor {name!r}: the commit marker says {described(said)}; {other} {described(truth)}"


def _model_name(name: str) -> bool:
    try:
        check_model_name(name)
    except InvalidArgument:
        return False
    return True
