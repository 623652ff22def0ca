"""The gRPC inference client, and the channels, errors and replicas the learner shares with it."""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from weightsvc.client._base import InferenceClient
from weightsvc.client._common import (
    Credentials,
    Progress,
    Receiver,
    VersionInfo,
    check_delta,
    patched,
    pull_parts,
)
from weightsvc.client._targets import transport_of
from weightsvc.errors import (
    BY_GRPC_CODE,
    DataLoss,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    WeightsvcError,
    subject,
)
from weightsvc.memory import alloc
from weightsvc.protocol.clients import ClientStatus
from weightsvc.protocol.fabric import Lease, lease_from_proto
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.names import PULL
from weightsvc.protocol.selection import Select
from weightsvc.protocol.topology import REPLICA_TTL_S, Replica
from weightsvc.protocol.wire import (
    HTTP2_FRAME_OPTION,
    ChunkView,
    decode_pull_response,
    manifest_from_proto,
    select_to_proto,
)
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

T = TypeVar("T")
PROBE_TIMEOUT_S = 1.0  # a replica left out of pushes that answers within this is back
# What gRPC reports when the port speaks HTTP/1.1 (the service's HTTP port, a web proxy).
_HTTP_PEER = ("Expected SETTINGS frame", "Trying to connect an http1.x server")


def error(e: grpc.RpcError, target: str) -> WeightsvcError:
    """The domain error of a failed call, carrying the server's message and status code name."""
    code = e.code().name if e.code() else "UNKNOWN"
    details = e.details() or ""
    err: WeightsvcError
    if any(s in details for s in _HTTP_PEER):
        err = Unavailable(
            f"UNAVAILABLE: {target} answers HTTP, not gRPC: give an HTTP client http://{target.split('://')[-1]}, "
            f"or give this one the service's gRPC port ({details})"
        )
    else:
        err = BY_GRPC_CODE.get(code, WeightsvcError)(f"{code}: {details}")
    err.grpc_code = code
    return err


@contextlib.contextmanager
def errors_of(target: str) -> Iterator[None]:
    """Calls made inside raise domain errors, not `grpc.RpcError`."""
    try:
        yield
    except grpc.RpcError as e:
        raise error(e, target) from None


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _with_token(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = tuple(d.metadata or ()) + self._metadata
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)  # type: ignore[attr-defined]

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # A client of its own: a new client connects at once, even while another one in this
    # process waits out its reconnect backoff to the same address (a restarted server).
    ("grpc.use_local_subchannel_pool", 1),
    HTTP2_FRAME_OPTION,
)


def channel(target: str, credentials: Credentials, who: str = "this client speaks gRPC") -> grpc.Channel:
    """`host:port` in clear, `grpcs://host:port` over TLS (system roots, or the CA bundle given)."""
    if (transport := transport_of(target)) != "grpc":
        raise InvalidArgument(
            f"{target} is an {transport.upper()} URL, and {who}: give host:port (or grpcs://host:port for TLS), "
            f"the service's gRPC port"
        )
    options = list(CHANNEL_OPTIONS)
    if target.startswith("grpcs://"):
        tls = grpc.ssl_channel_credentials(credentials.ca)
        ch = grpc.secure_channel(target.removeprefix("grpcs://"), tls, options)
    else:
        ch = grpc.insecure_channel(target.removeprefix("grpc://"), options)
    return grpc.intercept_channel(ch, _Bearer(credentials.token)) if credentials.token else ch


class Replicas:
    """The replicas of a deployment (GetTopology) and a channel to each, for sharded pushes and pulls."""

    def __init__(self, first: grpc.Channel, target: str, credentials: Credentials, timeout: float | None) -> None:
        self._stub = pb_grpc.WeightServiceStub(first)
        self._channels: dict[str, grpc.Channel] = {target: first}  # by address; the first one is the caller's
        self._target, self._credentials, self._timeout = target, credentials, timeout
        self._known: dict[str, Replica] = {}
        self._lock = threading.Lock()
        self.replication = 1  # how many replicas hold each tensor, as the deployment says
        self.left_out: dict[str, float] = {}  # replicas a push could not reach -> until when to leave them out

    def topology(self) -> list[Replica]:
        reply = self.ask(lambda stub: stub.GetTopology(pb.GetTopologyRequest(), timeout=self._timeout))
        replicas = [Replica(r.id, r.grpc, r.http) for r in reply.replicas]
        with self._lock:
            self._known = {r.id: r for r in replicas}
            self.replication = max(1, reply.replication)
        return replicas

    def live(self) -> list[Replica]:
        """The replicas a push goes to: the topology, less those left out lately that still do not answer."""
        now = time.monotonic()
        self.left_out = {r: until for r, until in self.left_out.items() if until > now}
        replicas = self.topology()
        for r in replicas:
            if r.id in self.left_out and self._answers(r):
                del self.left_out[r.id]  # back already
        return [r for r in replicas if r.id not in self.left_out]

    def _answers(self, replica: Replica) -> bool:
        stub = pb_grpc.WeightServiceStub(self.channel(replica.id, "probing a replica"))
        try:
            with errors_of(replica.grpc):
                stub.GetTopology(pb.GetTopologyRequest(), timeout=PROBE_TIMEOUT_S)
            return True
        except WeightsvcError:
            return False

    def leave_out(self, replica_id: str) -> None:
        """Leave a replica that could not be reached out of pushes until the registry forgets it (it
        stays in the topology that long after it went down)."""
        self.left_out[replica_id] = time.monotonic() + REPLICA_TTL_S

    def ask(self, call: Callable[[pb_grpc.WeightServiceStub], T]) -> T:
        """`call` on the first replica, or, if it cannot be reached, on each other known one in turn."""
        try:
            with errors_of(self._target):
                return call(self._stub)
        except Unavailable:
            others = [r for r in self._known.values() if r.grpc != self._target]
            for r in others:
                with contextlib.suppress(Unavailable), errors_of(r.grpc):
                    return call(pb_grpc.WeightServiceStub(self.channel(r.id, "asking the deployment")))
            raise

    def channel(self, replica_id: str, what: str) -> grpc.Channel:
        """A channel to the replica `replica_id` (asked for again once, if it is not known yet)."""
        if replica_id not in self._known:
            self.topology()
        replica = self._known.get(replica_id)
        if replica is None:
            raise Unavailable(f"{what}: replica {replica_id!r} is not in the topology (it is down or has left)")
        with self._lock:
            if replica.grpc not in self._channels:
                self._channels[replica.grpc] = channel(replica.grpc, self._credentials)
            return self._channels[replica.grpc]

    def close(self) -> None:
        """Close every channel, the caller's first one included."""
        for ch in list(self._channels.values()):
            ch.close()


def _pull_method(ch: grpc.Channel) -> Any:
    """Pull on `ch`: pre-encoded chunks come back as views, not copies (`transport.wire`)."""
    return ch.unary_stream(PULL, request_serializer=pb.PullRequest.SerializeToString,
                           response_deserializer=decode_pull_response)


def _read_manifest(stream: Iterator[object], where: str, max_tensors: int) -> Manifest | None:
    """The manifest a Pull stream starts with, and its pieces (None: it did not start with one)."""
    first = next(stream, None)
    if not (isinstance(first, pb.PullResponse) and first.HasField("manifest")):
        return None
    head, more = first.manifest, []
    _check_count(head, where, max_tensors)
    got = len(head.tensors)
    while got < head.tensor_count:
        piece = next(stream, None)
        if not (isinstance(piece, pb.PullResponse) and piece.HasField("manifest_tensors")
                and piece.manifest_tensors.tensors):
            raise DataLoss(f"{where}: the manifest ended after {got} of its {head.tensor_count} tensors")
        more.append(piece.manifest_tensors.tensors)
        got += len(piece.manifest_tensors.tensors)
    return manifest_from_proto(head, itertools.chain.from_iterable(more))


def _check_count(head: pb.Manifest, where: str, max_tensors: int) -> None:
    """A manifest that announces more tensors than a client takes is refused before they are read."""
    if head.tensor_count > max_tensors or len(head.tensors) > max_tensors:
        raise ResourceExhausted(f"{where}: the manifest announces {max(head.tensor_count, len(head.tensors))} "
                                f"tensors, more than the {max_tensors} this client takes (Limits.max_tensors)",
                                reason="too_large")


class GrpcInferenceClient(InferenceClient):
    """Pulls served copies over gRPC: `host:port`, or `grpcs://host:port` for TLS."""

    transport = "grpc"

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._channel = channel(target, self.credentials)
        self._stub = pb_grpc.WeightServiceStub(self._channel)
        self._replicas = Replicas(self._channel, target, self.credentials, self.timeout)
        self._own(self._replicas.close)

    def _call(self, rpc: Callable[..., T], request: object) -> T:
        with errors_of(self.target):
            return rpc(request, timeout=self.timeout)

    # ---- pulls ---------------------------------------------------------------------------------

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
        manifest: Manifest | None = None
        rx: Receiver | None = None  # made at the first chunk: its size depends on whether a delta comes
        delta = False
        ch = self._channel if owner is None else self._replicas.channel(owner, subject(model, version))
        pull = _pull_method(ch)
        selected = select_to_proto(select) if select is not None else []

        def attempt() -> None:
            nonlocal manifest, rx, delta
            # After a break, ask for the same version from the first byte we do not have yet.
            pinned = version if manifest is None else str(manifest.version)
            request = pb.PullRequest(model=model, version=pinned, offset=rx.pos if rx else 0,
                                     base="" if held is None else str(held[0].version), select=selected)
            with errors_of(self.target):
                stream = pull(request, timeout=self.timeout)
                got = _read_manifest(stream, subject(model, pinned), self.limits.max_tensors)
                if got is None:
                    raise DataLoss(f"{subject(model, pinned)}: the pull did not start with a manifest")
                got = self.limits.check(got, model, pinned)  # before anything is allocated for it
                if manifest is not None and got.master_digest != manifest.master_digest:
                    raise DataLoss(f"{subject(model, pinned)} changed while resuming its pull")
                manifest = got
                where = subject(model, manifest.version)
                for chunk in stream:
                    if isinstance(chunk, pb.PullResponse) and chunk.HasField("delta"):
                        if rx is None:  # the bytes that follow encode changes from the held version
                            delta = True
                            size = check_delta(manifest, chunk.delta.delta_bytes, where)
                            rx = Receiver(alloc(size), 0, size, moved, f"{where} (delta on version {request.base})")
                        continue
                    if not isinstance(chunk, ChunkView):
                        raise DataLoss(f"{where}: unexpected message in the pull stream")
                    if rx is None:
                        rx = Receiver(alloc(manifest.data_bytes), 0, manifest.data_bytes, moved, where)
                    rx.put(chunk.offset, chunk.data)

        self.retry.run(attempt, resumable=lambda: manifest is not None)
        assert manifest is not None
        received = rx.pos if rx else 0
        if manifest.parts and not delta and received < manifest.data_bytes:
            # Sharded replicas: the replica asked sent its own part (if it came first); the others'
            # parts come from their owners, all at once.
            data = rx.data if rx else alloc(manifest.data_bytes)
            pull_parts(self.retry, manifest, data, received, moved, self._pull_part)
            return manifest, data
        expected = rx.end if rx else manifest.data_bytes
        if received != expected:
            raise DataLoss(
                f"{subject(model, manifest.version)}: stream ended after {received} of {expected} bytes"
            )
        data = rx.data if rx else alloc(0)
        return (manifest, patched(manifest, held, data)) if delta and held else (manifest, data)

    def _pull_part(self, manifest: Manifest, source: str, rx: Receiver) -> None:
        pull = _pull_method(self._replicas.channel(source, rx.where))
        request = pb.PullRequest(model=manifest.model, version=str(manifest.version), offset=rx.pos)
        with errors_of(self.target):
            stream = pull(request, timeout=self.timeout)
            first = _read_manifest(stream, rx.where, self.limits.max_tensors)
            if first is None or first.master_digest != manifest.master_digest:
                raise DataLoss(f"{rx.where}: the replica answered with another version")
            for chunk in stream:
                if not isinstance(chunk, ChunkView):
                    raise DataLoss(f"{rx.where}: unexpected message in the pull stream")
                rx.put(chunk.offset, chunk.data)

    # ---- leases over NIXL ----------------------------------------------------------------------

    def _lease(self, model: str, version: str, select: Select | None, lease_s: float,
               base: int | None = None) -> Lease:
        request = pb.LeaseVersionRequest(model=model, version=version, lease_s=lease_s,
                                         select=select_to_proto(select) if select is not None else (),
                                         base="" if base is None else str(base))
        head = self._call(self._stub.LeaseVersion, request)
        where = subject(model, head.manifest.version)
        try:
            _check_count(head.manifest, where, self.limits.max_tensors)
            more, got = [], len(head.manifest.tensors)
            while got < head.manifest.tensor_count:  # a big lease comes in pieces: ask from where we got to
                piece = self._call(self._stub.LeaseVersion, pb.LeaseVersionRequest(lease_id=head.lease_id,
                                                                                   tensors_from=got))
                if piece.manifest.master_digest != head.manifest.master_digest or not piece.manifest.tensors:
                    raise DataLoss(f"{where}: its lease changed or ended after {got} of {head.manifest.tensor_count} "
                                   "tensors")
                more.append(piece)
                got += len(piece.manifest.tensors)
            lease = lease_from_proto(head, where, more)
            self.limits.check(lease.manifest, model, version)
        except BaseException:
            with contextlib.suppress(WeightsvcError):  # (else it ends at its deadline)
                self._release(head.lease_id)
            raise
        return lease

    def _release(self, lease_id: str) -> None:
        self._call(self._stub.ReleaseLease, pb.ReleaseLeaseRequest(lease_id=lease_id))

    # ---- metadata ------------------------------------------------------------------------------

    def manifest(self, model: str = "default", version: int | str = "latest") -> Manifest:
        head = self._call(self._stub.GetManifest, pb.GetManifestRequest(model=model, version=str(version)))
        _check_count(head, subject(model, head.version), self.limits.max_tensors)
        more, got = [], len(head.tensors)
        while got < head.tensor_count:  # a big manifest comes in pieces: ask from where we got to
            piece = self._call(self._stub.GetManifest, pb.GetManifestRequest(
                model=model, version=str(head.version), tensors_from=got))
            if piece.master_digest != head.master_digest or not piece.tensors:
                raise DataLoss(f"{subject(model, head.version)}: its manifest changed or ended after "
                               f"{got} of {head.tensor_count} tensors")
            more.append(piece.tensors)
            got += len(piece.tensors)
        return self.limits.check(manifest_from_proto(head, itertools.chain.from_iterable(more)), model, version)

    def versions(self, model: str = "default") -> list[VersionInfo]:
        resp = self._call(self._stub.ListVersions, pb.ListVersionsRequest(model=model))
        return [VersionInfo.from_proto(v) for v in resp.versions]

    def models(self) -> list[dict[str, Any]]:
        resp = self._call(self._stub.ListModels, pb.ListModelsRequest())
        return [
            {"model": m.model, "latest_version": m.latest_version, "versions": list(m.versions)} for m in resp.models
        ]

    def damaged_files(self) -> list[dict[str, str]]:
        resp = self._call(self._stub.ListModels, pb.ListModelsRequest())
        return [{"model": d.model, "file": d.file, "reason": d.reason} for d in resp.damaged_files]

    def topology(self) -> list[Replica]:
        return self._replicas.topology()

    def clients(self, model: str = "default") -> list[ClientStatus]:
        resp = self._call(self._stub.ListClients, pb.ListClientsRequest(model=model))
        return [ClientStatus(c.client_id, c.version, c.lag_versions, c.last_seen_unix, c.connected)
                for c in resp.clients]

    # ---- watch and ack -------------------------------------------------------------------------

    def _events(self, model: str, after: int | None) -> Iterator[VersionInfo]:
        request = pb.WatchRequest(model=model)
        if after is not None:
            request.after_version = after
        with errors_of(self.target):
            for event in self._stub.Watch(request):
                yield VersionInfo.from_proto(event.version)

    def _ack(self, model: str, version: int, client_id: str) -> int:
        resp = self._call(self._stub.Ack, pb.AckRequest(model=model, version=version, client_id=client_id))
        return int(resp.latest_version)
