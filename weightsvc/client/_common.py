"""What the clients share: version info, credentials, the retry policy, the one place pulled bytes
land, checksum verification, version files, and pulls of a version made of parts.

Nothing here imports torch: the CLI's `status`, `pull` to a file and `push` start without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from weightsvc.errors import (
    DataLoss,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    WeightsvcError,
    subject,
)
from weightsvc.memory import alloc, half_the_memory
from weightsvc.protocol.digest import verify_data
from weightsvc.protocol.lag import LagMetrics
from weightsvc.protocol.manifest import Manifest, Part, check_manifest, manifest_from_header
from weightsvc.protocol.mismatch import RolloutMismatch, mismatch_from_proto
from weightsvc.protocol.refs import parse_version_ref
from weightsvc.protocol.safetensors import header_length, read_safetensors_header
from weightsvc.protocol.selection import Select, by_part, joined
from weightsvc.protocol.wire import lag_from_proto

if TYPE_CHECKING:
    import torch

    from weightsvc.v1 import weightsvc_pb2 as pb

T = TypeVar("T")
Progress = Callable[[int], None]
READ_BYTES = 4 << 20  # one read of a response body into the buffer


MAX_TENSORS = 1_000_000  # tensors of a version a client takes by default: the server's default --max-tensors


@dataclass
class Limits:
    """What a client takes of a server: versions whose data section is at most `max_bytes` (by default
    what a server takes, `--max-version-bytes`; a delta pull holds as much again for the delta's
    encoding, as it needs its base beside it) and that have at most `max_tensors` tensors."""

    max_bytes: int = field(default_factory=half_the_memory)
    max_tensors: int = MAX_TENSORS

    def check(self, manifest: Manifest, model: str, version: int | str) -> Manifest:
        """A manifest as a server sent it, checked (`check_manifest`) to be a sound one of the version
        asked for and within these limits, before anything is allocated for it (DATA_LOSS,
        RESOURCE_EXHAUSTED)."""
        try:
            return check_manifest(manifest, model=model, version=parse_version_ref(version),
                                  max_bytes=self.max_bytes, max_tensors=self.max_tensors)
        except ResourceExhausted as e:
            raise ResourceExhausted(f"{e.message} (this client's {self})", reason=e.reason) from None


@dataclass(frozen=True)
class VersionInfo:
    model: str
    version: int
    format: str
    rounding: str
    committed_unix: float
    tensor_count: int
    data_bytes: int
    created: bool = True
    lag: LagMetrics | None = None
    # The trainer-rollout mismatch learners reported for this version (over every report), and the
    # learner step of the latest report; in listings only.
    mismatch: RolloutMismatch | None = None
    mismatch_step: int | None = None
    # push(return_served=True): the served tensors of this version, checksums verified.
    served: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_proto(cls, info: pb.VersionInfo, created: bool = True) -> VersionInfo:
        return cls(
            info.model,
            info.version,
            info.format,
            info.rounding,
            info.committed_unix,
            info.tensor_count,
            info.data_bytes,
            created,
            lag_from_proto(info),
            mismatch_from_proto(info.mismatch) if info.HasField("mismatch") else None,
            info.mismatch_step if info.HasField("mismatch_step") else None,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VersionInfo:
        """A version as the HTTP routes list it (`Manifest.info`); fields this client does not know are ignored."""
        known = {f.name for f in dataclasses.fields(cls)} - {"lag", "served", "mismatch"}
        lag = LagMetrics(**d["lag"]) if d.get("lag") else None
        mismatch = RolloutMismatch(**d["mismatch"]) if d.get("mismatch") else None
        return cls(**{k: v for k, v in d.items() if k in known}, lag=lag, mismatch=mismatch)


@dataclass(frozen=True)
class Credentials:
    """The bearer token and the CA bundle (PEM) a client uses."""

    token: str | None = field(default=None, repr=False)
    ca: bytes | None = None

    @classmethod
    def resolve(cls, token: str | None, ca_cert: str | Path | bytes | None) -> Credentials:
        """Given, or $WEIGHTSVC_TOKEN / $WEIGHTSVC_CA_CERT; an empty token means none."""
        token = token if token is not None else os.environ.get("WEIGHTSVC_TOKEN") or None
        ca = ca_cert if ca_cert is not None else os.environ.get("WEIGHTSVC_CA_CERT") or None
        return cls(token or None, ca if isinstance(ca, bytes) or ca is None else Path(ca).read_bytes())


# Status codes of a connection or stream that broke off (a restart, a proxy, the network): worth
# another try. CANCELLED too: a server shutting down cancels the streams it is sending.
RETRYABLE_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "CANCELLED"})


@dataclass(frozen=True)
class RetryPolicy:
    """When a pull or a watch that broke off is tried again, and how long it waits first.

    Both transports raise domain errors carrying a gRPC status code name (HTTP errors too); a lost
    connection is `Unavailable`. A pull resumes from the first byte it does not have yet."""

    attempts: int = 3  # tries after the first
    backoff: float = 0.1  # the first wait in seconds, doubled after each try
    max_backoff: float = 2.0
    deadline: float | None = None  # seconds after the first break past which nothing is tried again

    @staticmethod
    def retryable(e: BaseException) -> bool:
        return isinstance(e, WeightsvcError) and e.grpc_code in RETRYABLE_CODES

    def delay(self, attempt: int, max_backoff: float | None = None) -> float:
        return min(self.max_backoff if max_backoff is None else max_backoff, self.backoff * 2**attempt)

    def run(
        self,
        attempt: Callable[[], T],
        *,
        also: tuple[type[WeightsvcError], ...] = (),
        resumable: Callable[[], bool] = lambda: True,
    ) -> T:
        """`attempt()` until it returns; a retryable error (or one of `also`) is tried again while
        `resumable()` holds, within `attempts` and `deadline`."""
        first_break: float | None = None
        for n in itertools.count():
            try:
                return attempt()
            except WeightsvcError as e:
                now = time.monotonic()
                first_break = now if first_break is None else first_break
                wait = self.delay(n)
                late = self.deadline is not None and now + wait - first_break > self.deadline
                if not (self.retryable(e) or isinstance(e, also)) or n >= self.attempts or late or not resumable():
                    raise
            time.sleep(wait)
        raise AssertionError("unreachable")


class Readable(Protocol):
    def readinto(self, b: memoryview, /) -> int | None: ...


class Receiver:
    """The one place pulled bytes land: in order, into `data[pos:end]`, each count reported.

    A pull that breaks keeps its receiver: the next try asks for the bytes from `pos` on."""

    def __init__(self, data: memoryview, pos: int, end: int, moved: Progress, where: str) -> None:
        self.data, self.pos, self.end = data, pos, end
        self.moved = moved
        self.where = where

    @property
    def full(self) -> bool:
        return self.pos == self.end

    def put(self, offset: int, piece: memoryview | bytes) -> None:
        """The bytes at `offset` of a stream: they must follow what came before, within `end`."""
        n = len(piece)
        if offset != self.pos or self.pos + n > self.end:
            raise DataLoss(
                f"{self.where}: {n} bytes arrived at offset {offset}; expected offset {self.pos} "
                f"with at most {self.end - self.pos} bytes left"
            )
        self.data[self.pos : self.pos + n] = piece
        self.pos += n
        self.moved(n)

    def read(self, body: Readable) -> None:
        """Read a response body until `end`; a body that ends short is a broken stream."""
        while self.pos < self.end:
            n = body.readinto(self.data[self.pos : min(self.end, self.pos + READ_BYTES)])
            if not n:
                raise Unavailable(f"UNAVAILABLE: {self.where}: the body ended at byte {self.pos} of {self.end}")
            self.pos += n
            self.moved(n)


def read_version_file(path: str | Path) -> tuple[Manifest, memoryview]:
    """The manifest and data section of a safetensors file written by weightsvc.

    The data is writable memory, as a pull's is: torch tensors are views of it."""
    with open(path, "rb") as f:
        raw = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(raw)
    start, header = read_safetensors_header(raw[: 8 + header_length(raw)])
    return manifest_from_header(header), memoryview(raw)[start:]


def read_base_file(path: str | Path, model: str, base: int) -> tuple[Manifest, memoryview]:
    """The version a previous pull wrote to `path`, checked to be version `base` of `model` and
    verified (before anything is built on it)."""
    held = read_version_file(path)
    if (held[0].model, held[0].version) != (model, base):
        raise InvalidArgument(
            f"{path} holds {subject(held[0].model, held[0].version)}, not {subject(model, base)}"
        )
    verify_data(*held)
    return held


def write_version_file(path: str | Path, manifest: Manifest, data: bytearray | memoryview) -> None:
    """Write a version as a safetensors file, whole or not at all: a reader never sees half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.part")
    try:
        with open(tmp, "wb") as f:
            f.write(manifest.safetensors_header())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def check_delta(manifest: Manifest, nbytes: object, where: str) -> int:
    """The size of the delta a server announced for `manifest`: a delta is sent only where it is
    smaller than the data section."""
    if type(nbytes) is not int or not 0 <= nbytes <= manifest.data_bytes:
        raise DataLoss(f"{where}: the server announced a delta of {nbytes!r} bytes for a data section of "
                       f"{manifest.data_bytes}")
    return nbytes


def patched(manifest: Manifest, held: tuple[Manifest, memoryview], delta: memoryview) -> memoryview:
    """The data section of `manifest`: the held version's, with `delta` applied."""
    if len(held[1]) != manifest.data_bytes:  # (a server sends a delta only between versions of one layout)
        raise DataLoss(f"{subject(manifest.model, manifest.version)}: a delta on version {held[0].version} "
                       f"of {len(held[1])} bytes cannot make a data section of {manifest.data_bytes}")
    full = alloc(manifest.data_bytes)
    full[:] = held[1]
    try:
        from weightsvc.protocol.delta import apply as delta_apply  # numpy: loaded by delta pulls only

        delta_apply(manifest, delta, full)
    except (ValueError, struct.error) as e:
        raise DataLoss(
            f"{subject(manifest.model, manifest.version)}: bad delta on version {held[0].version}: {e}"
        ) from None
    return full


def check_pull(model: str, base: int | None, select: Select | None, held: tuple[Manifest, memoryview] | None) -> None:
    """A pull of `model` asks for what it can get: a delta on the version `held`, or a selection (not
    empty, and not as a delta)."""
    if select is not None:
        if base is not None:
            raise InvalidArgument(f"model {model!r}: a selection cannot be pulled as a delta (base {base}): "
                                  "pull the selection without a base")
        if not select:
            raise InvalidArgument(f"model {model!r}: the selection is empty: select at least one tensor")
    if base is not None and (held is None or held[0].version != base):
        raise InvalidArgument(f"model {model!r}: this client holds no copy of version {base} to pull a delta on")


def gather(jobs: list[Callable[[], None]], name: str) -> None:
    """Run `jobs` at once, one thread each; the first error is raised once all have ended."""
    if not jobs:
        return
    with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix=name) as pool:
        for f in [pool.submit(job) for job in jobs]:
            f.result()


# ---- a version made of parts (sharded replicas) ----------------------------------------------


def from_holders(retry: RetryPolicy, part: Part, attempt: Callable[[str], T], where: str) -> T:
    """`attempt(replica)` on the replicas that hold `part`, one after the other while they cannot
    answer (down, or yet to learn of the version); each is tried with the retry policy. Parts
    start on different holders, so a fleet's pulls spread over them."""
    sources = part.sources
    first = part.offset % len(sources) if len(sources) > 1 else 0
    failures: list[str] = []
    for source in sources[first:] + sources[:first]:
        try:
            # NOT_FOUND too: a holder learns that the version committed a moment after the replica
            # that took the last part (it reads the registry's events).
            return retry.run(lambda s=source: attempt(s), also=(NotFound,))  # type: ignore[misc]
        except (Unavailable, NotFound) as e:
            failures.append(f"{source}: {e.message}")
    raise Unavailable(f"{where}: no replica that holds it answered ({'; '.join(failures)})")


def pull_parts(retry: RetryPolicy, manifest: Manifest, data: memoryview, received: int, moved: Progress,
               pull_part: Callable[[Manifest, str, Receiver], None]) -> None:
    """The bytes of `manifest`'s parts above `received`, each from a replica that holds it, all at
    once; `pull_part(manifest, replica, rx)` is one try at the bytes `rx` still wants."""
    where = subject(manifest.model, manifest.version)

    def pull(part: Part) -> None:
        end = part.offset + part.nbytes
        rx = Receiver(data, max(part.offset, received), end, moved,
                      f"{where}, part [{part.offset}, {end}) of replicas {list(part.sources)}")
        from_holders(retry, part, lambda source: pull_part(manifest, source, rx), rx.where)
        if not rx.full:
            raise DataLoss(f"{rx.where}: got bytes up to {rx.pos} of its part [{part.offset}, {end})")

    todo = [p for p in manifest.parts if p.nbytes and p.offset + p.nbytes > received]
    gather([lambda p=p: pull(p) for p in todo], "weightsvc-part")  # type: ignore[misc]


def pull_selection_by_part(retry: RetryPolicy, whole: Manifest, select: Select,
                           pull: Callable[[Select, str], tuple[Manifest, memoryview]]) -> tuple[Manifest, memoryview]:
    """A selection of a version of parts: each part's tensors from a replica that holds them
    (`pull(group, replica)`), all at once, joined in part order."""
    groups = by_part(whole, select)
    got: dict[Part, tuple[Manifest, memoryview]] = {}

    def pull_group(part: Part, group: Select) -> None:
        where = f"{subject(whole.model, whole.version)}, tensors of replicas {list(part.sources)}"
        got[part] = from_holders(retry, part, lambda source: pull(group, source), where)

    gather([lambda p=p, g=g: pull_group(p, g) for p, g in groups.items()], "weightsvc-part")  # type: ignore[misc]
    return joined([got[p] for p in sorted(groups, key=lambda p: p.offset)])
