"""gRPC adapter: translates weightsvc.v1 messages to core calls; errors are mapped once, below."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from weightsvc.core.manifest import TensorSpec, parse_version_ref
from weightsvc.core.push import PushChunk, PushCommit, PushHeader, PushMessage
from weightsvc.core.service import Service
from weightsvc.core.topology import HASHING
from weightsvc.errors import DeadlineExceeded, InvalidArgument, WeightsvcError
from weightsvc.transport.auth import Auth, GrpcAuth
from weightsvc.transport.names import SERVICE
from weightsvc.transport.wire import (
    ChunkView,
    Malformed,
    decode_push_request,
    encode_chunk,
    encode_message,
    info_to_proto,
    manifest_to_proto,
)
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

log = logging.getLogger("weightsvc.grpc")


def _abort_on_domain_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map errors to status codes for unary and streaming handlers: a WeightsvcError to its own
    code and message, anything unexpected to INTERNAL (logged with its traceback)."""

    async def abort(context: grpc.aio.ServicerContext, e: Exception) -> None:
        if isinstance(e, WeightsvcError):
            await context.abort(getattr(grpc.StatusCode, e.grpc_code), e.message)
        log.exception("internal error in %s", fn.__name__)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

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
    def __init__(self, service: Service) -> None:
        self.service = service

    @_abort_on_domain_error
    async def Push(self, request_iterator: AsyncIterator[pb.PushRequest], context: Any) -> pb.PushResponse:
        version, created = await self.service.push(_push_messages(request_iterator))
        return pb.PushResponse(version=info_to_proto(version.manifest), created=created)

    @_abort_on_domain_error
    async def Pull(self, request: pb.PullRequest, context: Any) -> None:
        chunk = self.service.settings.chunk_bytes
        stall = self.service.settings.pull_stall_timeout_s

        async def write(message: pb.PullResponse | bytes) -> None:
            # Written here rather than yielded: a client that stops reading holds the version, and
            # only a timeout around the write (which waits on flow control) can take it back.
            try:
                async with asyncio.timeout(stall):
                    await context.write(message)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"model {request.model!r} version {version.manifest.version}: the client read nothing for "
                    f"{stall:g} s (--pull-stall-timeout-s); pull dropped",
                    reason="stalled",
                ) from None

        version = self.service.open_pull(request.model, parse_version_ref(request.version), "grpc")
        try:
            data, delta_header = version.data, None
            if request.base and version.part is None:  # a delta against a version the client holds, if smaller
                delta = await self.service.delta(version, parse_version_ref(request.base))
                if delta is not None:
                    data = memoryview(delta)
                    delta_header = pb.Delta(base_version=int(request.base), delta_bytes=len(delta))
            total = len(data) if delta_header else version.manifest.data_bytes
            if not 0 <= request.offset <= total:
                raise InvalidArgument(
                    f"model {request.model!r} version {version.manifest.version}: resume offset {request.offset} "
                    f"is outside its {total}-byte data section"
                )
            # A replica holding one part sends the bytes of its part from the offset on; asked for an
            # offset outside its part, the manifest alone (it tells the client who holds the rest).
            start, end = version.held if delta_header is None else (0, len(data))
            first = request.offset if start <= request.offset <= end else end
            await write(pb.PullResponse(manifest=manifest_to_proto(version.manifest)))
            if delta_header is not None:
                await write(pb.PullResponse(delta=delta_header))
            for offset in range(first, end, chunk):
                piece = data[offset - start : offset - start + chunk]
                await write(encode_chunk("", offset, piece))  # pre-encoded: one copy, not three
                self.service.count_pulled(version.manifest.model, "grpc", len(piece))
        finally:
            self.service.close_pull(version, "grpc")

    @_abort_on_domain_error
    async def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelSummary(**dataclasses.asdict(m)) for m in self.service.models()])

    @_abort_on_domain_error
    async def ListVersions(self, request: pb.ListVersionsRequest, context: Any) -> pb.ListVersionsResponse:
        return pb.ListVersionsResponse(versions=[info_to_proto(m) for m in self.service.versions(request.model)])

    @_abort_on_domain_error
    async def GetManifest(self, request: pb.GetManifestRequest, context: Any) -> pb.Manifest:
        return manifest_to_proto(self.service.manifest(request.model, parse_version_ref(request.version)))

    @_abort_on_domain_error
    async def Watch(self, request: pb.WatchRequest, context: Any) -> AsyncIterator[pb.VersionEvent]:
        after = request.after_version if request.HasField("after_version") else None
        async for manifest in self.service.watch(request.model, after):
            yield pb.VersionEvent(version=info_to_proto(manifest))

    @_abort_on_domain_error
    async def GetTopology(self, request: pb.GetTopologyRequest, context: Any) -> pb.Topology:
        replicas = await self.service.topology()
        return pb.Topology(replicas=[pb.Replica(**dataclasses.asdict(r)) for r in replicas], hashing=HASHING)

    @_abort_on_domain_error
    async def Ack(self, request: pb.AckRequest, context: Any) -> pb.AckResponse:
        latest = self.service.ack(request.model, request.version, request.client_id or context.peer())
        return pb.AckResponse(latest_version=latest)


async def _push_messages(
    requests: AsyncIterator[pb.PushRequest | ChunkView | Malformed],
) -> AsyncIterator[PushMessage]:
    async for req in requests:
        if isinstance(req, ChunkView):  # the bulk path: views into the received message
            yield PushChunk(req.tensor, req.offset, req.data)
            continue
        if isinstance(req, Malformed):
            raise InvalidArgument(req.reason, reason="bad_chunk")
        kind = req.WhichOneof("kind")
        if kind == "chunk":
            yield PushChunk(req.chunk.tensor, req.chunk.offset, req.chunk.data)
        elif kind == "header":
            h = req.header
            yield PushHeader(
                model=h.model,
                step=h.step,
                tensors=tuple(
                    TensorSpec(t.name, tuple(t.shape), t.dtype, _part(t.part) if t.HasField("part") else None)
                    for t in h.tensors
                ),
                format=h.format,
                rounding=h.rounding,
                rank=h.rank,
                world_size=h.world_size or 1,
                owners=tuple(h.owners),
            )
        elif kind == "commit":
            yield PushCommit()
        else:
            raise InvalidArgument("empty push message: set one of header, chunk, commit", reason="bad_chunk")


def _part(part: pb.TensorPart) -> tuple[int, int]:
    return part.offset, part.count


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


async def start_grpc(
    service: Service, host: str, port: int, *, auth: Auth | None = None, tls: tuple[bytes, bytes] | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server (WeightService + health); returns it and the bound port.
    `tls` is (certificate chain, private key) in PEM."""
    server = grpc.aio.server(
        options=grpc_options(service.settings.max_message_bytes), interceptors=[GrpcAuth(auth)] if auth else None
    )
    servicer = WeightServicer(service)
    handlers = {
        # The bulk methods use the zero-copy chunk framing of `_wire`.
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push,
            request_deserializer=decode_push_request,
            response_serializer=pb.PushResponse.SerializeToString,
        ),
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull,
            request_deserializer=pb.PullRequest.FromString,
            response_serializer=encode_message,
        ),
    }
    for name, request, response, kind in (
        ("ListModels", pb.ListModelsRequest, pb.ListModelsResponse, grpc.unary_unary_rpc_method_handler),
        ("ListVersions", pb.ListVersionsRequest, pb.ListVersionsResponse, grpc.unary_unary_rpc_method_handler),
        ("GetManifest", pb.GetManifestRequest, pb.Manifest, grpc.unary_unary_rpc_method_handler),
        ("Watch", pb.WatchRequest, pb.VersionEvent, grpc.unary_stream_rpc_method_handler),
        ("Ack", pb.AckRequest, pb.AckResponse, grpc.unary_unary_rpc_method_handler),
        ("GetTopology", pb.GetTopologyRequest, pb.Topology, grpc.unary_unary_rpc_method_handler),
    ):
        handlers[name] = kind(
            getattr(servicer, name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
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
