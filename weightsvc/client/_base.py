"""`InferenceClient`, the base of each transport's client: pulls (whole, delta, selected, of parts),
version files, watch and ack, over the transport's calls.

Nothing here imports torch: the CLI's `status`, `pull` to a file and `push` start without it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from weightsvc.client._common import (
    Credentials,
    Limits,
    Progress,
    Receiver,
    RetryPolicy,
    VersionInfo,
    check_pull,
    pull_selection_by_part,
    read_base_file,
    verify_data,
    write_version_file,
)
from weightsvc.client._targets import ByTarget
from weightsvc.errors import DataLoss, FailedPrecondition, InvalidArgument, Unavailable, WeightsvcError, subject
from weightsvc.protocol.clients import ClientStatus
from weightsvc.protocol.fabric import DEFAULT_LEASE_S, Lease
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.selection import Select
from weightsvc.protocol.topology import Replica

if TYPE_CHECKING:
    import torch

    from weightsvc.client._nixl import Reader

T = TypeVar("T")
log = logging.getLogger("weightsvc.client")
_READER: Reader | None = None  # one NIXL agent per process, for every client (made at its first pull_into)
_READER_LOCK = threading.Lock()


class InferenceClient(ByTarget):
    """Pulls served copies. `target` is "host:port" (or "grpcs://host:port") for gRPC, "http://host:port"
    (or "https://...") for HTTP, "s3://bucket/prefix" for an object store a server writes to.

    `InferenceClient(target)` returns the transport's client (`GrpcInferenceClient`,
    `HttpInferenceClient` or `StoreInferenceClient`, picked by `weightsvc.client._targets`); each
    offers every pull, and each is an `InferenceClient`."""

    family = "inference"

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        resume_attempts: int = 3,
        token: str | None = None,
        ca_cert: str | Path | bytes | None = None,
        retry: RetryPolicy | None = None,
        limits: Limits | None = None,
    ) -> None:
        """`token`: a bearer token with role pull (default: $WEIGHTSVC_TOKEN); `ca_cert`: a PEM
        bundle to trust for `grpcs://` and `https://` targets (default: $WEIGHTSVC_CA_CERT).
        A pull broken mid-stream resumes from its offset up to `resume_attempts` times (`retry`:
        the whole policy). Every manifest a server sends is checked, and refused over `limits`
        (default `Limits()`: half the memory this process may use), before anything is allocated for it."""
        self.target = target
        self.timeout = timeout
        self.credentials = Credentials.resolve(token, ca_cert)
        self.retry = retry or RetryPolicy(attempts=resume_attempts)
        self.limits = limits or Limits()
        self._held: dict[str, tuple[Manifest, memoryview]] = {}  # the last version pulled, per model
        self.last_pull_bytes = 0  # payload bytes the last pull received (a delta is smaller)
        self._count_lock = threading.Lock()
        self._closed = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._nixl_sources: list[str] = []  # the other servers that lend its versions, as the last lease named them
        self._sources: dict[str, InferenceClient] = {}  # their clients, made at a READ that moved to them

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

    def _lease(self, model: str, version: str, select: Select | None, lease_s: float,
               base: int | None = None) -> Lease:
        """A lease of the version (or the selection; or the delta encoding against `base`) to READ over
        NIXL (`serve --nixl`)."""
        raise FailedPrecondition(f"{self.target}: this target lends nothing over NIXL", reason="nixl_off")

    def _release(self, lease_id: str) -> None:
        raise NotImplementedError

    def clients(self, model: str = "default") -> list[ClientStatus]:
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

    def pull_into(
        self,
        tensors: Mapping[str, torch.Tensor],
        model: str = "default",
        version: int | str = "latest",
        *,
        select: Select | None = None,
        base: int | None = None,
        fallback: bool = True,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> Manifest:
        """READ a version (or, with `select`, its selected tensors and slices) over NIXL straight into
        `tensors`: preallocated, contiguous tensors by name, one per tensor pulled, of its served dtype
        and (sliced) shape, all in host memory or all on one GPU. Every byte is checked against the
        checksums any pull checks; returns the manifest (the selection's, with `select`). The server
        lends the version for `lease_s` seconds at most: a READ that outlasts it fails (DEADLINE_EXCEEDED).

        With `base`, `tensors` hold that version (a whole one, as an earlier `pull_into` left them): the
        server lends the delta encoding against it when it has one, and only the changes are read and
        patched in (in host memory; tensors on a GPU are read whole).

        A lease names the other servers that lend the version: a READ that fails at one moves to the
        next. When NIXL cannot be had (not installed here, a server without --nixl, no source that can
        be reached), one line says so and the version comes over this client's transport into the same
        tensors, unless `fallback` is False (the error is raised then). After a failed pull, what the
        tensors hold is not to be used."""
        from weightsvc.client import _nixl

        where = subject(model, version)
        if base is not None and select is not None:
            raise InvalidArgument(f"{where}: a selection cannot be read as a delta (base {base}): read it whole")
        try:
            return _nixl.pull_into(self, self._source, self._nixl_sources, self._nixl_reader, tensors, model,
                                   str(version), select, base, lease_s)
        except (FailedPrecondition, Unavailable) as e:
            if not fallback:  # (a server without --nixl, or one that holds other tensors: TCP serves both)
                raise
            log.warning("%s: NIXL cannot reach %s (%s): pulling over %s", where, self.target, e.message,
                        self.transport)
        manifest, data = self.pull_data(model, version, select=select)
        _nixl.check_destination(manifest, tensors)
        verify_data(manifest, data)
        _nixl.copy_into(manifest, data, tensors)
        return manifest

    def _source(self, target: str) -> InferenceClient:
        """A client of another server that lends the same versions (named by a lease), as this one's."""
        if target not in self._sources:
            self._sources[target] = InferenceClient(target, timeout=self.timeout, token=self.credentials.token,
                                                    ca_cert=self.credentials.ca, retry=self.retry, limits=self.limits)
        return self._sources[target]

    def _nixl_reader(self) -> Reader:
        """This process's NIXL reader, made at the first pull over NIXL."""
        from weightsvc.client._nixl import Reader

        global _READER
        with _READER_LOCK:
            if _READER is None:
                _READER = Reader()
            return _READER

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
            self.hold(*read_base_file(path, model, base))
        manifest, data = self.pull_data(model, version, base=base, progress=progress)
        verify_data(manifest, data)
        write_version_file(path, manifest, data)
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
        held = self._held.get(model)
        check_pull(model, base, select, held)
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
            manifest, data = pull_selection_by_part(self.retry, whole, select, lambda group, source: self._pull(
                model, str(whole.version), None, moved, select=group, owner=source))
        sent = {t.name: t.slice for t in manifest.tensors}
        if sent != dict(select):
            raise DataLoss(f"{subject(model, manifest.version)}: the server sent another selection "
                           f"({sorted(sent)}) than the one asked for ({sorted(select)})")
        return manifest, data

    def held(self, model: str = "default") -> Manifest | None:
        """The manifest of the version this client holds of `model` (its last pull): a delta base."""
        held = self._held.get(model)
        return held[0] if held is not None else None

    def hold(self, manifest: Manifest, data: memoryview) -> None:
        """Remember a version this client has (the base of a later delta pull of its model)."""
        self._held[manifest.model] = (manifest, data)

    # ---- watch and ack -------------------------------------------------------------------------

    def watch(
        self, model: str = "default", after: int | None = None, *, reconnect: bool = True, max_backoff: float = 5.0
    ) -> Generator[VersionInfo, None, None]:
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
        for source in self._sources.values():
            source.close()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
