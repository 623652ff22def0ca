"""The data dir: committed versions and ef residuals as files, written durably and read back at start-up.

Layout: `<data dir>/models/<model>/<version:020d>.safetensors` (the version's safetensors file) and
`residual-<version:020d>.safetensors` beside it (the ef residual after that version). Every method is
blocking file I/O, called in a worker thread or at start-up: `VersionFiles` holds no state of the
event loop's, so what it keeps or removes is passed in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from weightsvc._faults import crash_point
from weightsvc.errors import DiskFull, InvalidArgument, Unavailable, WeightsvcError, subject
from weightsvc.protocol.digest import verify
from weightsvc.protocol.manifest import manifest_from_header
from weightsvc.protocol.refs import MAX_STEP, check_model_name
from weightsvc.protocol.safetensors import MAX_HEADER_BYTES, framed, header_length, read_safetensors_header
from weightsvc.rounding import RESIDUAL_FORMAT_KEY, RESIDUAL_SCALING_KEY, RESIDUAL_VERSION_KEY, Residual
from weightsvc.service.record import Version, VersionFile

log = logging.getLogger("weightsvc.store")
_serial = itertools.count()


@dataclasses.dataclass(frozen=True)
class DamagedFile:
    """A file restore found damaged: its model, where it is now (under `<data dir>/damaged/<model>/`,
    unless it could not be moved) and why it was set aside."""

    model: str
    file: str
    reason: str


class VersionFiles:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.damaged: list[DamagedFile] = []  # what restore set aside, for the metric, `status` and listings

    def path(self, model: str, version: int) -> Path:
        """Where a version's file lies; refused unless under the data dir, whatever named the model (a
        learner, a relay's upstream): names are checked where they arrive, and here before any file."""
        check_model_name(model)
        if not (isinstance(version, int) and 0 <= version <= MAX_STEP):
            raise InvalidArgument(f"model {model!r}: version {version!r} is not a step in [0, {MAX_STEP}]")
        path = self.data_dir / "models" / model / f"{version:020d}.safetensors"
        if not path.resolve().is_relative_to(self.data_dir.resolve()):
            raise InvalidArgument(f"{subject(model, version)}: {path} is not under the data dir "
                                  f"{self.data_dir}: refused")
        return path

    def residual_path(self, model: str, version: int) -> Path:
        return self.path(model, version).with_name(f"residual-{version:020d}.safetensors")

    def record_path(self, model: str, version: int) -> Path:
        """Beside a sharded replica's part: the registry's record of the version it committed in."""
        return self.path(model, version).with_name(f"{version:020d}.record.json")

    def stage(self, model: str, version: int, header_bytes: int, data_bytes: int) -> VersionFile:
        """A temporary file in the model's directory for a push to export into: room for a header of
        up to `header_bytes`, then the data section (page-aligned), mapped read-write. Its blocks are
        allocated now, so a full disk is an answer here rather than a fault while writing the mapping."""
        path = self.path(model, version)
        tmp = self._tmp(path)
        start = -(-max(header_bytes, 8) // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "w+b")  # noqa: SIM115 (the returned VersionFile owns it)
            try:
                os.posix_fallocate(f.fileno(), 0, start + data_bytes)
                mapping = mmap.mmap(f.fileno(), start + data_bytes)
            except BaseException:
                f.close()
                tmp.unlink(missing_ok=True)
                raise
        except OSError as e:
            raise _failure(f"{subject(model, version)}: cannot persist to {path.parent}", e,
                           start + data_bytes, self.data_dir) from None
        return VersionFile(tmp, f, mapping, start)

    @staticmethod
    def discard(staged: VersionFile) -> None:
        """A staged file that did not become a version (or already did, under its own name)."""
        staged.close()
        staged.path.unlink(missing_ok=True)

    def write(self, version: Version) -> Version:
        """Put the version's file in place whole or not at all (synced, then renamed); returns the
        version served from that file, mapped read-only. A version staged in a file (`stage`) gets
        its header written in front of its data; one held in memory (a relay's) is written whole."""
        m = version.manifest
        path = self.path(m.model, m.version)
        staged = version.file
        in_place = staged is not None and len(version.header) <= staged.data_start
        tmp = staged.path if staged is not None and in_place else self._tmp(path)
        try:
            if staged is not None and in_place:
                _write_padded(staged.mapping, version.header, staged.data_start)
                os.fsync(staged.file.fileno())  # (the mapping's pages too, see `_write_padded`)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(version.header)
                    f.write(version.data)
                    f.flush()
                    os.fsync(f.fileno())
            crash_point("commit.version-written")
            os.replace(tmp, path)
            _sync_dir(path.parent)
            file = _open(path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            needed = len(version.header) + (0 if in_place else len(version.data))
            raise _failure(f"{subject(m.model, m.version)}: cannot persist to {path.parent}", e, needed,
                           self.data_dir) from None
        return dataclasses.replace(version, header=bytes(file.mapping[: file.data_start]), data=file.data, file=file)

    @staticmethod
    def _tmp(path: Path) -> Path:
        """A temporary name beside `path`, unique to this write (restore removes what is left of it)."""
        return path.with_name(f".{path.name}.{os.getpid()}-{next(_serial)}.tmp")

    def stage_residual(self, model: str, version: int, numels: dict[str, int], format: str,
                       scaling: str) -> tuple[VersionFile, dict[str, np.ndarray]]:
        """A temporary residual file for an `ef` push to write its new residual into (the layout
        `Residual.save` writes), and each tensor's residual as an array mapping it: a big model's
        residual lives in the page cache, not in this process's memory."""
        offsets, end = {}, 0
        for name, numel in numels.items():
            offsets[name], end = (end, end + 4 * numel), end + 4 * numel
        meta = {RESIDUAL_VERSION_KEY: str(version), RESIDUAL_FORMAT_KEY: format, RESIDUAL_SCALING_KEY: scaling}
        entries = {n: {"dtype": "F32", "shape": [numels[n]], "data_offsets": list(o)} for n, o in offsets.items()}
        raw = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path = self.residual_path(model, version)
        tmp = self._tmp(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "w+b")  # noqa: SIM115 (the returned VersionFile owns it)
            try:
                os.posix_fallocate(f.fileno(), 0, 8 + len(raw) + end)
                mapping = mmap.mmap(f.fileno(), 8 + len(raw) + end)
            except BaseException:
                f.close()
                tmp.unlink(missing_ok=True)
                raise
        except OSError as e:
            raise _failure(f"{subject(model, version)}: cannot persist the ef residual to {path.parent}",
                           e, 8 + len(raw) + end, self.data_dir) from None
        mapping[: 8 + len(raw)] = framed(raw)
        staged = VersionFile(tmp, f, mapping, 8 + len(raw))
        start = staged.data_start
        arrays = {n: np.frombuffer(mapping, np.float32, numels[n], start + o[0]) for n, o in offsets.items()}
        return staged, arrays

    def write_residual(self, model: str, residual: Residual, staged: VersionFile | None = None) -> None:
        """Write the ef residual after `residual.version`, named by that version (from the file it was
        staged in, when it was)."""
        assert residual.version is not None
        path = self.residual_path(model, residual.version)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if staged is None:
                residual.save(path)
                return
            os.fsync(staged.file.fileno())  # (the mapping's pages too, see `_write_padded`)
            os.replace(staged.path, path)
            _sync_dir(path.parent)
        except OSError as e:
            needed = sum(r.nbytes for r in residual.tensors.values())
            raise _failure(f"{subject(model, residual.version)}: cannot persist the ef residual to "
                           f"{path.parent}", e, needed, self.data_dir) from None

    def remove(self, model: str, version: int, residual: bool) -> None:
        """The files of a version that did not commit (best effort: the failure itself is reported)."""
        with contextlib.suppress(OSError):
            self.path(model, version).unlink(missing_ok=True)
            self.record_path(model, version).unlink(missing_ok=True)
            if residual:
                self.residual_path(model, version).unlink(missing_ok=True)

    def free_bytes(self) -> int:
        """Bytes free for this process on the data dir's filesystem."""
        st = os.statvfs(self.data_dir)
        return st.f_bavail * st.f_frsize

    def allocated(self, model: str, version: int) -> int:
        """Bytes the disk holds for a version's file (0 when it has none)."""
        try:
            return self.path(model, version).stat().st_blocks * 512
        except FileNotFoundError:
            return 0

    def evict(self, model: str, version: int) -> None:
        """Delete a committed version's file to make room, durably: a restart does not bring it back."""
        path = self.path(model, version)
        path.unlink(missing_ok=True)
        self.record_path(model, version).unlink(missing_ok=True)
        _sync_dir(path.parent)

    def prune(self, model: str, versions: list[int], residual: int | None, upto: int | None = None) -> None:
        """Remove the files of `versions` (evicted, or not committed) and every residual file but the
        one of version `residual`: only the model's current ef state is kept. With `upto` (the latest
        committed version), a residual file above it stays: the next commit has just written it."""
        for v in versions:
            self.path(model, v).unlink(missing_ok=True)
            self.record_path(model, v).unlink(missing_ok=True)
        kept = None if residual is None else self.residual_path(model, residual)
        for path in self.path(model, 0).parent.glob("residual-*.safetensors"):
            number = path.stem.removeprefix("residual-")
            in_flight = upto is not None and number.isdigit() and int(number) > upto
            if path != kept and not in_flight:
                path.unlink(missing_ok=True)

    def restore(self) -> Iterator[tuple[str, list[Version], Residual | None]]:
        """Each model's committed versions in the data dir, oldest first, and the ef residual after
        its latest one. Skips damaged files; removes writes that never reached their rename."""
        root = self.data_dir / "models"
        for model_dir in sorted(root.iterdir()) if root.is_dir() else []:
            for tmp in model_dir.glob(".*.tmp"):
                tmp.unlink()  # a write that never reached its rename: never committed
            versions = []
            for path in sorted(model_dir.glob("[0-9]*.safetensors")):
                try:
                    version = load_version(path)
                    m = version.manifest
                    if (m.model, f"{m.version:020d}.safetensors") != (model_dir.name, path.name):
                        raise ValueError(f"its manifest is of {subject(m.model, m.version)}")
                except Exception as e:  # one damaged file must not take the others down
                    self._set_aside(path, e)
                    continue
                versions.append(version)
            latest = versions[-1].manifest.version if versions else None
            yield model_dir.name, versions, self._residual(model_dir, latest)

    def _set_aside(self, path: Path, e: Exception) -> None:
        """Move a damaged file out of the versions, under damaged/, for an operator to look at: left
        in place it would be skipped again at every start, and a later commit of its number would
        replace the only evidence."""
        aside = self.data_dir / "damaged" / path.parent.name / path.name
        reason = str(e) or type(e).__name__
        try:
            aside.parent.mkdir(parents=True, exist_ok=True)
            while aside.exists():
                aside = aside.with_name(aside.name + ".again")
            path.rename(aside)
        except OSError as moved:
            log.error("damaged file %s (%s) could not be moved aside: %s", path, reason, moved)
            self.damaged.append(DamagedFile(path.parent.name, str(path), f"{reason} (not moved aside: {moved})"))
            return
        log.error("damaged file %s (%s): moved to %s", path, reason, aside)
        self.damaged.append(DamagedFile(path.parent.name, str(aside), reason))

    def _residual(self, model_dir: Path, latest: int | None) -> Residual | None:
        """The residual after the latest committed version, if its file is sound (a damaged one is set
        aside: the next ef push starts from a zero residual). Only that one continues (as in a live
        process); one of a version that never committed (a crash between the two writes) or of an
        older one is not used."""
        path = model_dir / f"residual-{latest:020d}.safetensors" if latest is not None else None
        if path is None or not path.exists():
            return None
        try:
            return _map_residual(path)
        except Exception as e:
            self._set_aside(path, e)
            return None


def load_version(path: Path) -> Version:
    """A version's file, mapped read-only, its tensors' checksums verified."""
    file = _open(path)
    try:
        prefix = bytes(file.mapping[: file.data_start])
        manifest = manifest_from_header(read_safetensors_header(prefix)[1])
        # The whole header, not only the manifest it carries: its tensor entries (names, shapes,
        # offsets) are what a plain safetensors reader of the download goes by.
        if prefix[8:].rstrip(b" ") != manifest.safetensors_header()[8:].rstrip(b" "):
            raise ValueError("its header differs from the one its manifest makes (tensor names, shapes or offsets)")
        data = file.data
        if len(data) != manifest.data_bytes:
            raise ValueError(f"data section is {len(data)} bytes, manifest says {manifest.data_bytes}")
        for t in manifest.tensors:
            verify(t.name, data[t.offset : t.offset + t.nbytes], t.checksum, where=str(path))
    except BaseException:
        file.close()
        raise
    return Version(manifest, prefix, data, file=file)


def write_record(files: VersionFiles, model: str, version: int, record: str) -> None:
    """Keep the registry's record of a committed version of parts beside this replica's part, durably:
    should the registry lose it, the version is given back from it (`_restore`)."""
    path = files.record_path(model, version)
    tmp = files._tmp(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(record)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_dir(path.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise _failure(f"{subject(model, version)}: cannot keep the registry's record in {path.parent}",
                       e, len(record), files.data_dir) from None


def read_record(files: VersionFiles, model: str, version: int) -> str | None:
    """The registry's record kept beside a part (`write_record`), or None: none was kept (its version
    never committed as far as this replica knows) or it cannot be read."""
    try:
        return files.record_path(model, version).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _open(path: Path) -> VersionFile:
    """A version's file, open and mapped read-only."""
    f = open(path, "rb")  # noqa: SIM115 (the returned VersionFile owns it)
    try:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(mapping) < 8:
            raise ValueError(f"{len(mapping)} bytes: not a safetensors file")
        header_len = header_length(mapping)
        if header_len > min(len(mapping) - 8, MAX_HEADER_BYTES):
            raise ValueError(f"header length {header_len} is out of range")
    except BaseException:
        f.close()
        raise
    return VersionFile(path, f, mapping, 8 + header_len)


def _map_residual(path: Path) -> Residual:
    """A residual file (as `Residual.save` writes it), its arrays mapping the file copy-on-write: a
    big model's residual is read from the page cache, and the kernels may take the arrays as writable."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    start, header = read_safetensors_header(mapping[: 8 + min(header_length(mapping), MAX_HEADER_BYTES)])
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        lo, hi = entry["data_offsets"]
        if entry["dtype"] != "F32" or start + hi > len(mapping) or (hi - lo) % 4:
            raise ValueError(f"tensor {name!r}: not an F32 residual within the file")
        tensors[name] = np.frombuffer(mapping, np.float32, (hi - lo) // 4, start + lo)
    version = meta.get(RESIDUAL_VERSION_KEY, "")
    return Residual(int(version) if version else None, tensors, meta.get(RESIDUAL_FORMAT_KEY, ""),
                    meta.get(RESIDUAL_SCALING_KEY, ""))


def _sync_dir(directory: Path) -> None:
    """Make a rename or delete in `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


COPY_SLICE = 8 << 20  # bytes copied at once into a mapping (each copy holds the GIL)


def _write_padded(mapping: mmap.mmap, header: bytes, size: int) -> None:
    """Write the safetensors prefix `header` at the start of `mapping`, grown to `size` bytes (its JSON
    padded with spaces, as the format allows), in slices: the header of 400,000 tensors is ~100 MB, and
    one copy of it (page faults included) would hold the GIL, and so the event loop, for 0.1 s or more.
    Made durable by the file's fsync: on Linux it writes a shared mapping's dirty pages too, and it
    lets go of the GIL, where the mapping's own flush (msync) holds it: 2 s for a GiB of data."""
    if len(header) > size:
        raise ValueError(f"a header of {len(header)} bytes does not fit in {size}")
    view = memoryview(header)
    mapping[:8] = (size - 8).to_bytes(8, "little")
    for start in range(8, len(header), COPY_SLICE):
        end = min(start + COPY_SLICE, len(header))
        mapping[start:end] = view[start:end]
    mapping[len(header) : size] = b" " * (size - len(header))


def _failure(where: str, e: OSError, needed: int, data_dir: Path) -> WeightsvcError:
    """A write that failed: a full disk (or quota) is RESOURCE_EXHAUSTED with the bytes it needed and
    those free (`DiskFull`, which the committer makes room for), anything else UNAVAILABLE."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            st = os.statvfs(data_dir)
            free = f"{st.f_bavail * st.f_frsize:,}"
        except OSError:
            free = "an unknown number of"
        return DiskFull(f"{where}: {e.strerror}: it needs {needed:,} bytes, {free} are free", needed=needed)
    return Unavailable(f"{where}: {e}", reason="other")
