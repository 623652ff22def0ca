"""What both inference transports share: credentials, the retry policy, the one place pulled bytes
land, checksum verification, and the `InferenceClient` base that picks the transport by target.

Nothing here imports torch: the CLI's `status`, `pull` to a file and `push` start without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from weightsvc.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, Unavailable, WeightsvcError
from weightsvc.memory import alloc
from weightsvc.protocol.digest import verify
from weightsvc.protocol.lag import LagMetrics
from weightsvc.protocol.manifest import DTYPE_SIZES, Manifest, Part, manifest_from_header
from weightsvc.protocol.safetensors import header_length, read_safetensors_header
from weightsvc.protocol.selection import Select, by_part, joined
from weightsvc.protocol.topology import Replica
from weightsvc.protocol.wire import lag_from_proto

if TYPE_CHECKING:
    import torch

    from weightsvc.v1 import weightsvc_pb2 as pb

T = TypeVar("T")
Progress = Callable[[int], None]
READ_BYTES = 4 << 20  # one read of a response body into the buffer


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
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VersionInfo:
        """A version as the HTTP routes list it (`Manifest.info`); fields this client does not know are ignored."""
        known = {f.name for f in dataclasses.fields(cls)} - {"lag", "served"}
        lag = LagMetrics(**d["lag"]) if d.get("lag") else None
        return cls(**{k: v for k, v in d.items() if k in known}, lag=lag)


@dataclass(frozen=True)
class ClientInfo:
    """An inference client of a model, as its acks left it."""

    client_id: str
    version: int  # the version it acked last
    lag_versions: int  # versions committed after it
    last_seen_unix: float
    connected: bool  # acked recently


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


def verify_data(manifest: Manifest, data: bytearray | memoryview) -> None:
    """Check that every served tensor fits the data section and matches its manifest checksum."""
    view = memoryview(data)
    where = f"model {manifest.model!r} version {manifest.version}"
    for t in manifest.tensors:
        if (
            t.dtype not in DTYPE_SIZES
            or t.nbytes != math.prod(t.shape) * DTYPE_SIZES[t.dtype]
            or (t.offset + t.nbytes > len(view))
        ):
            raise DataLoss(
                f"{where}: tensor {t.name!r} ({t.dtype}, shape {list(t.shape)}, {t.nbytes} bytes "
                f"at {t.offset}) does not fit the manifest's data section"
            )
        verify(t.name, view[t.offset : t.offset + t.nbytes], t.checksum, where=where)


def read_version_file(path: str | Path) -> tuple[Manifest, memoryview]:
    """The manifest and data section of a safetensors file written by weightsvc.

    The data is writable memory, as a pull's is: torch tensors are views of it."""
    with open(path, "rb") as f:
        raw = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(raw)
    start, header = read_safetensors_header(raw[: 8 + header_length(raw)])
    return manifest_from_header(header), memoryview(raw)[start:]


def _is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def gather(jobs: list[Callable[[], None]], name: str) -> None:
    """Run `jobs` at once, one thread each; the first error is raised once all have ended."""
    if not jobs:
        return
    with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix=name) as pool:
        for f in [pool.submit(job) for job in jobs]:
            f.result()


class InferenceClient:
    """Pulls served copies. `target` is "host:port" (or "grpcs://host:port") for gRPC,
    "http://host:port" (or "https://...") for HTTP.

    `InferenceClient(target)` returns the transport's client (`GrpcInferenceClient` or
    `HttpInferenceClient`); both offer every operation, and both are `InferenceClient`s."""

    transport: str = ""  # "grpc" or "http"

    def __new__(cls, target: str, **kwargs: Any) -> InferenceClient:
        return super().__new__(_transport_class(target) if cls is InferenceClient else cls)

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        resume_attempts: int = 3,
        token: str | None = None,
        ca_cert: str | Path | bytes | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        """`token`: a bearer token with role pull (default: $WEIGHTSVC_TOKEN); `ca_cert`: a PEM
        bundle to trust for `grpcs://` and `https://` targets (default: $WEIGHTSVC_CA_CERT).
        A pull broken mid-stream resumes from its offset up to `resume_attempts` times (`retry`:
        the whole policy)."""
        self.target = target
        self.timeout = timeout
        self.credentials = Credentials.resolve(token, ca_cert)
        self.retry = retry or RetryPolicy(attempts=resume_attempts)
        self._held: dict[str, tuple[Manifest, memoryview]] = {}  # the last version pulled, per model
        self.last_pull_bytes = 0  # payload bytes the last pull received (a delta is smaller)
        self._count_lock = threading.Lock()
        self._closed = False
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _own(self, release: Callable[[], None]) -> None:
        """`release` frees what this client opened, at `close` or when the client is garbage.
        It must not refer to the client itself, or the client would never be garbage."""
        self._finalizer = weakref.finalize(self, release)

    # ---- the transport's part (each transport's class defines all of these) ---------------------

    def _pull(
        self,
        model: str,
        version: str,
        held: tuple[Manifest, memoryview] | None,
        moved: Progress,
        *,
        select: Select | None = None,
        owner: str | None = None,
    ) -> tuple[Manifest, memoryview]:
        """A version's manifest and data section; with `held`, as a delta on it when the server sends one;
        with `select`, the selection's manifest and data section, from the replica `owner` if given."""
        raise NotImplementedError

    def _pull_part(self, manifest: Manifest, source: str, rx: Receiver) -> None:
        """One try at the bytes `rx` still wants of a part, from the replica `source` that holds it."""
        raise NotImplementedError

    def _from_holders(self, part: Part, attempt: Callable[[str], T], where: str) -> T:
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
                return self.retry.run(lambda s=source: attempt(s), also=(NotFound,))  # type: ignore[misc]
            except (Unavailable, NotFound) as e:
                failures.append(f"{source}: {e.message}")
        raise Unavailable(f"{where}: no replica that holds it answered ({'; '.join(failures)})")

    def _events(self, model: str, after: int | None) -> Iterator[VersionInfo]:
        """One watch stream: the versions above `after` (all when None), then each new one."""
        raise NotImplementedError

    def manifest(self, model: str = "default", version: int | str = "latest") -> Manifest:
        raise NotImplementedError

    def versions(self, model: str = "default") -> list[VersionInfo]:
        raise NotImplementedError

    def models(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def damaged_files(self) -> list[dict[str, str]]:
        """The files the server found damaged at start-up and set aside: `model`, `file` (where it is
        now) and `reason`, of every model."""
        raise NotImplementedError

    def topology(self) -> list[Replica]:
        """The replicas of the deployment, as its registry knows them (sorted by id)."""
        raise NotImplementedError

    def _ack(self, model: str, version: int, client_id: str) -> int:
        raise NotImplementedError

    def clients(self, model: str = "default") -> list[ClientInfo]:
        """The inference clients that acked versions of `model`."""
        raise NotImplementedError

    # ---- pulls ---------------------------------------------------------------------------------

    def pull(
        self,
        model: str = "default",
        version: int | str = "latest",
        *,
        base: int | None = None,
        select: Select | None = None,
        progress: Progress | None = None,
    ) -> dict[str, torch.Tensor]:
        """The served tensors of a version (checksums verified), by name; `base`, `select`: see `pull_data`."""
        from weightsvc.client._tensors import tensors_from_data

        return tensors_from_data(*self.pull_data(model, version, base=base, select=select, progress=progress))

    def iter_weights(
        self,
        model: str = "default",
        version: int | str = "latest",
        *,
        select: Select | None = None,
        progress: Progress | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`(name, tensor)` pairs of a version, checksums verified, as vLLM's `model.load_weights`
        and SGLang's `update_weights_from_tensor` take them (fp8 scales come as `<name>_scale_inv`)."""
        yield from self.pull(model, version, select=select, progress=progress).items()

    def pull_file(
        self,
        path: str | Path,
        model: str = "default",
        version: int | str = "latest",
        *,
        base: int | None = None,
        progress: Progress | None = None,
    ) -> Manifest:
        """Write a version as a safetensors file (checksums verified first); returns its manifest.

        With `base`, the file at `path` must hold that version (as written by a previous pull): only
        the changes are pulled, and the file is replaced by the new version."""
        if base is not None:
            held = read_version_file(path)
            if (held[0].model, held[0].version) != (model, base):
                raise InvalidArgument(
                    f"{path} holds model {held[0].model!r} version {held[0].version}, "
                    f"not model {model!r} version {base}"
                )
            verify_data(*held)  # verified before anything is built on it
            self.hold(*held)
        manifest, data = self.pull_data(model, version, base=base, progress=progress)
        verify_data(manifest, data)
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
        return manifest

    def pull_data(
        self,
        model: str = "default",
        version: int | str = "latest",
        *,
        base: int | None = None,
        select: Select | None = None,
        progress: Progress | None = None,
    ) -> tuple[Manifest, memoryview]:
        """The manifest and the raw data section of a version (not yet verified).

        With `base`, only the changes from that version are sent when that is smaller: the client
        must hold it, from its previous pull of the model (or `hold`).

        With `select` (tensor name -> `Slice(dim, start, stop)`, or None for the whole tensor), only
        those tensors, sliced: the manifest is the selection's (each tensor with the slice's shape, the
        checksum of the slice's bytes and its `slice`), and the selection is not held as a delta base."""
        if select is not None:
            if base is not None:
                raise InvalidArgument(f"model {model!r}: a selection cannot be pulled as a delta (base {base}): "
                                      "pull the selection without a base")
            if not select:
                raise InvalidArgument(f"model {model!r}: the selection is empty: select at least one tensor")
        held = self._held.get(model)
        if base is not None and (held is None or held[0].version != base):
            raise InvalidArgument(f"model {model!r}: this client holds no copy of version {base} to pull a delta on")
        self.last_pull_bytes = 0

        def moved(n: int) -> None:  # part pulls call this from their threads
            with self._count_lock:
                self.last_pull_bytes += n
            if progress:
                progress(n)

        if select is not None:
            return self._pull_selection(model, str(version), select, moved)
        manifest, data = self._pull(model, str(version), held if base is not None else None, moved)
        self._held[model] = (manifest, data)
        return manifest, data

    def _pull_selection(self, model: str, version: str, select: Select, moved: Progress) -> tuple[Manifest, memoryview]:
        """A selection of a version, checked to be the one asked for. A replica of a sharded version
        refuses a selection of tensors it does not hold: each owner's tensors then come from it, all
        at once, and are joined in owner order."""
        try:
            manifest, data = self._pull(model, version, None, moved, select=select)
        except FailedPrecondition:
            whole = self.manifest(model, version)
            if not whole.parts:
                raise
            groups = by_part(whole, select)
            got: dict[Part, tuple[Manifest, memoryview]] = {}

            def pull(part: Part, group: Select) -> None:
                where = f"model {model!r} version {whole.version}, tensors of replicas {list(part.sources)}"
                got[part] = self._from_holders(part, lambda source: self._pull(
                    model, str(whole.version), None, moved, select=group, owner=source), where)

            gather([lambda p=p, g=g: pull(p, g) for p, g in groups.items()], "weightsvc-part")  # type: ignore[misc]
            manifest, data = joined([got[p] for p in sorted(groups, key=lambda p: p.offset)])
        sent = {t.name: t.slice for t in manifest.tensors}
        if sent != dict(select):
            raise DataLoss(f"model {model!r} version {manifest.version}: the server sent another selection "
                           f"({sorted(sent)}) than the one asked for ({sorted(select)})")
        return manifest, data

    def held(self, model: str = "default") -> Manifest | None:
        """The manifest of the version this client holds of `model` (its last pull): a delta base."""
        held = self._held.get(model)
        return held[0] if held is not None else None

    def hold(self, manifest: Manifest, data: memoryview) -> None:
        """Remember a version this client has (the base of a later delta pull of its model)."""
        self._held[manifest.model] = (manifest, data)

    @staticmethod
    def _patched(manifest: Manifest, held: tuple[Manifest, memoryview], delta: memoryview) -> memoryview:
        """The data section of `manifest`: the held version's, with `delta` applied."""
        full = alloc(manifest.data_bytes)
        full[:] = held[1]
        try:
            from weightsvc.protocol.delta import apply as delta_apply  # numpy: loaded by delta pulls only

            delta_apply(manifest, delta, full)
        except (ValueError, struct.error) as e:
            raise DataLoss(
                f"model {manifest.model!r} version {manifest.version}: bad delta on version {held[0].version}: {e}"
            ) from None
        return full

    def _pull_parts(self, manifest: Manifest, data: memoryview, received: int, moved: Progress) -> None:
        """The bytes of `manifest`'s parts above `received`, each from its owner, all at once
        (a version of sharded replicas)."""
        where = f"model {manifest.model!r} version {manifest.version}"

        def pull(part: Part) -> None:
            end = part.offset + part.nbytes
            rx = Receiver(data, max(part.offset, received), end, moved,
                          f"{where}, part [{part.offset}, {end}) of replicas {list(part.sources)}")
            self._from_holders(part, lambda source: self._pull_part(manifest, source, rx), rx.where)
            if not rx.full:
                raise DataLoss(f"{rx.where}: got bytes up to {rx.pos} of its part [{part.offset}, {end})")

        todo = [p for p in manifest.parts if p.nbytes and p.offset + p.nbytes > received]
        gather([lambda p=p: pull(p) for p in todo], "weightsvc-part")  # type: ignore[misc]

    # ---- watch and ack -------------------------------------------------------------------------

    def watch(
        self, model: str = "default", after: int | None = None, *, reconnect: bool = True, max_backoff: float = 5.0
    ) -> Iterator[VersionInfo]:
        """Each retained version above `after` (all when None), then each new one as it commits.

        With `reconnect`, a lost server (restart, network) is retried with exponential backoff, and
        the watch resumes after the last version it yielded: the latest version is never missed.
        The watch ends when the client is closed."""
        last, lost = after, 0
        while True:
            try:
                for info in self._events(model, last):
                    lost = 0
                    last = info.version
                    yield info
            except WeightsvcError as e:
                if self._closed:
                    return
                if not (reconnect and self.retry.retryable(e)):
                    raise
            if not reconnect or self._closed:
                return
            time.sleep(self.retry.delay(lost, max_backoff))  # then a new stream (the connection too)
            lost += 1

    def ack(self, model: str, version: int, client_id: str | None = None) -> int:
        """Tell the service this client has loaded `version`; returns the latest version."""
        return self._ack(model, version, client_id or f"{socket.gethostname()}-{id(self):x}")

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the client's connections; a watch in progress ends."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _transport_class(target: str) -> type[InferenceClient]:
    if _is_http(target):
        from weightsvc.client._http import HttpInferenceClient

        return HttpInferenceClient
    from weightsvc.client._grpc import GrpcInferenceClient

    return GrpcInferenceClient
