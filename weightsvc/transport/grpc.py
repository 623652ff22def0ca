"""gRPC adapter: translates weightsvc.v1 messages to core calls; errors are mapped once, below."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightsvc._aio import BIG_MANIFEST, in_thread, off_loop
from weightsvc.errors import WeightsvcError
from weightsvc.protocol.fabric import DEFAULT_LEASE_S, lease_to_proto
from weightsvc.protocol.mismatch import fields_from_proto, mismatch_to_proto
from weightsvc.protocol.names import METHODS, REASON_KEY, SERVICE
from weightsvc.protocol.published import publish_from_proto
from weightsvc.protocol.refs import parse_version_ref
from weightsvc.protocol.topology import HASHING
from weightsvc.protocol.wire import (
    HTTP2_FRAME_OPTION,
    decode_push_request,
    encode_chunk,
    encode_message,
    info_to_proto,
    manifest_from,
    manifest_pieces,
    select_from_proto,
)
from weightsvc.service.service import Service
from weightsvc.transport._internals import HealthServicer
from weightsvc.transport.auth import Auth, GrpcAuth, peer_caller, token_caller
from weightsvc.transport.connections import GrpcConnections, headroom
from weightsvc.transport.push import push_messages
from weightsvc.transport.status import grpc_status
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

log = logging.getLogger("weightsvc.grpc")


def _abort_on_domain_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map errors to status codes for unary and streaming handlers: a WeightsvcError to its own
    code and message, anything unexpected to INTERNAL (logged with its traceback)."""

    async def abort(context: grpc.aio.ServicerContext, e: Exception) -> None:
        if isinstance(e, WeightsvcError):
            code, message = grpc_status(e), e.message
            trailing: tuple[tuple[str, str], ...] = ((REASON_KEY, e.reason),)
        else:
            log.exception("internal error in %s", fn.__name__)
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
            trailing = ()
        # gRPC keeps the abort, and so this error (its context), with the call's state: its traceback's
        # frames would keep what the call held alive (a refused push's header of 400,000 tensors).
        e.__traceback__ = None
        await context.abort(code, message, trailing_metadata=trailing)

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as e:
                await abort(context, e)

        return stream

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            await abort(context, e)

    return unary


class WeightServicer(pb_grpc.WeightServiceServicer):
    def __init__(self, service: Service, authenticated: bool = False) -> None:
        self.service = service
        self.authenticated = authenticated  # every call carries a valid token (GrpcAuth let it in)

    @_abort_on_domain_error
    async def Push(self, request_iterator: AsyncIterable[pb.PushRequest], context: Any) -> pb.PushResponse:
        # gRPC's request stream is an async generator held in a reference cycle with gRPC's own objects.
        # Left suspended (a push refused once its header is read), it holds the last message it received
        # (a piece of a big header: MiBs, in protobuf's memory) until a full garbage collection, which
        # `serve` makes rare: every refused push kept its own. Closed here, the message goes with the push.
        requests = cast(AsyncGenerator[pb.PushRequest, None], aiter(request_iterator))
        async with contextlib.aclosing(requests):
            manifest, created = await self.service.push(push_messages(requests, self.service.settings.max_tensors))
        return pb.PushResponse(version=info_to_proto(manifest), created=created)

    @_abort_on_domain_error
    async def Publish(self, request: pb.PublishRequest, context: Any) -> pb.PushResponse:
        published = await in_thread(len(request.tensors) >= BIG_MANIFEST, publish_from_proto, request)
        manifest, created = await self.service.publish(published)
        return pb.PushResponse(version=info_to_proto(manifest), created=created)

    @_abort_on_domain_error
    async def Pull(self, request: pb.PullRequest, context: Any) -> None:
        base = parse_version_ref(request.base) if request.base else None
        select = select_from_proto(request.select) if request.select else None
        pull = await self.service.open_pull(request.model, parse_version_ref(request.version), "grpc", base=base,
                                            select=select)
        try:
            chunks = pull.chunks(request.offset, self.service.settings.chunk_bytes)
            # Written rather than yielded: only the stall timeout around a write (which waits on flow
            # control) takes the version back from a client that stops reading.
            for message in await off_loop(manifest_pieces, pull.manifest):  # pre-encoded, in pieces
                await pull.send(context.write(message))
            if pull.base is not None:
                delta = pb.Delta(base_version=pull.base, delta_bytes=len(pull.body))
                await pull.send(context.write(pb.PullResponse(delta=delta)))
            for offset, piece in chunks:
                await pull.send(context.write(encode_chunk("", offset, piece)), len(piece))  # pre-encoded: one copy
        finally:
            pull.close()

    @_abort_on_domain_error
    async def LeaseVersion(self, request: pb.LeaseVersionRequest, context: Any) -> pb.VersionLease:
        if request.lease_id:  # the rest of a big lease
            lent = self.service.lent(request.lease_id)
            return await off_loop(lambda _, lease: lease_to_proto(lease, request.tensors_from), lent.manifest, lent)
        select = select_from_proto(request.select) if request.select else None
        base = parse_version_ref(request.base) if request.base else None
        lease = await self.service.lease(request.model, parse_version_ref(request.version), select,
                                         request.lease_s or DEFAULT_LEASE_S, base)
        return await off_loop(lambda _, lent: lease_to_proto(lent), lease.manifest, lease)

    @_abort_on_domain_error
    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Any) -> pb.ReleaseLeaseResponse:
        self.service.release_lease(request.lease_id)
        return pb.ReleaseLeaseResponse()

    @_abort_on_domain_error
    async def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelSummary(**dataclasses.asdict(m)) for m in self.service.models()],
                                     damaged_files=self._damaged(None))

    @_abort_on_domain_error
    async def ListVersions(self, request: pb.ListVersionsRequest, context: Any) -> pb.ListVersionsResponse:
        listed = await self.service.listed_versions(request.model)
        versions = [info_to_proto(m) if r is None else info_to_proto(m, r.mismatch, r.step) for m, r in listed]
        return pb.ListVersionsResponse(versions=versions, damaged_files=self._damaged(request.model))

    @_abort_on_domain_error
    async def ReportMismatch(self, request: pb.ReportMismatchRequest, context: Any) -> pb.ReportMismatchResponse:
        step = request.step if request.HasField("step") else None
        totals = await self.service.report_mismatch(
            request.model, {v: fields_from_proto(m) for v, m in request.versions.items()}, step)
        return pb.ReportMismatchResponse(versions={v: mismatch_to_proto(m) for v, m in totals.items()})

    def _damaged(self, model: str | None) -> list[pb.DamagedFile]:
        return [pb.DamagedFile(**dataclasses.asdict(d)) for d in self.service.damaged_files(model)]

    @_abort_on_domain_error
    async def GetManifest(self, request: pb.GetManifestRequest, context: Any) -> pb.Manifest:
        m = self.service.manifest(request.model, parse_version_ref(request.version))
        return await off_loop(manifest_from, m, request.tensors_from)

    @_abort_on_domain_error
    async def Watch(self, request: pb.WatchRequest, context: Any) -> AsyncIterator[pb.VersionEvent]:
        after = request.after_version if request.HasField("after_version") else None
        async for manifest in self.service.watch(request.model, after):
            yield pb.VersionEvent(version=info_to_proto(manifest))

    @_abort_on_domain_error
    async def GetTopology(self, request: pb.GetTopologyRequest, context: Any) -> pb.Topology:
        replicas = await self.service.topology()
        return pb.Topology(replicas=[pb.Replica(**dataclasses.asdict(r)) for r in replicas], hashing=HASHING,
                           replication=self.service.settings.replication)

    @_abort_on_domain_error
    async def Ack(self, request: pb.AckRequest, context: Any) -> pb.AckResponse:
        metadata = dict(context.invocation_metadata() or ())
        caller = token_caller(metadata.get("authorization")) if self.authenticated else peer_caller(context.peer())
        client_id = request.client_id or context.peer()
        latest = await self.service.ack(request.model, request.version, client_id, caller)
        return pb.AckResponse(latest_version=latest)

    @_abort_on_domain_error
    async def ListClients(self, request: pb.ListClientsRequest, context: Any) -> pb.ListClientsResponse:
        statuses = self.service.clients(request.model)
        latest = self.service.manifest(request.model, None).version
        return pb.ListClientsResponse(model=request.model, latest_version=latest,
                                      clients=[pb.ClientStatus(**dataclasses.asdict(c)) for c in statuses])


CONNECTION_IDLE_S = 300


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        HTTP2_FRAME_OPTION,
    ]


async def start_grpc(
    service: Service, host: str, port: int, *, auth: Auth | None = None, tls: tuple[bytes, bytes] | None = None,
    connections: GrpcConnections | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server (WeightService + health); returns it and the bound port.
    `tls` is (certificate chain, private key) in PEM; `connections` bounds the connections (and
    closes those that fail authentication)."""
    s = service.settings
    # Connections are bounded, and one that never finishes its handshake, or holds no call for
    # CONNECTION_IDLE_S, is closed (a client's channel reconnects when it next calls). gRPC admits
    # some beyond the bound: `connections` trims them back, the idle ones first.
    admitted = s.max_connections + (headroom(s.max_connections) if connections is not None else 0)
    limits = [("grpc.max_allowed_incoming_connections", admitted),
              ("grpc.server_handshake_timeout_ms", int(s.connect_timeout_s * 1000)),
              ("grpc.max_connection_idle_ms", int(CONNECTION_IDLE_S * 1000))]
    server = grpc.aio.server(
        options=grpc_options(s.max_message_bytes) + limits,
        interceptors=[GrpcAuth(auth, connections.refused if connections else None)] if auth else None,
    )
    servicer = WeightServicer(service, authenticated=auth is not None)
    # The bulk methods use the zero-copy chunk framing of `wire`; the others, the generated code's.
    framing: dict[str, tuple[Any, Any]] = {"Push": (decode_push_request, None), "Pull": (None, encode_message)}
    handlers = {}
    for name, m in METHODS.items():
        decode, encode = framing.get(name, (None, None))
        method = getattr(servicer, name)
        handlers[name] = m.handler(connections.tracked(method) if connections else method,
                                   request_deserializer=decode or m.request.FromString,
                                   response_serializer=encode or m.response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{host}:{port}"
    if tls is not None:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    await server.start()
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


async def stop_grpc(server: grpc.aio.Server, grace: float = 2.0) -> None:
    await asyncio.shield(server.stop(grace))
