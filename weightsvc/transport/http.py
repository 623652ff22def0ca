"""HTTP adapter (FastAPI): health, metrics, version lists, manifests, safetensors and delta downloads,
watch (server-sent events), acks and clients, and pushes (gRPC-framed PushRequests, or a safetensors file)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from weightsvc._aio import in_thread, memo, off_loop
from weightsvc.errors import (
    Aborted,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    WeightsvcError,
    subject,
)
from weightsvc.protocol.fabric import DEFAULT_LEASE_S
from weightsvc.protocol.manifest import Manifest
from weightsvc.protocol.published import publish_from_dict
from weightsvc.protocol.refs import parse_version_ref
from weightsvc.protocol.selection import parse_selector, selection
from weightsvc.protocol.topology import HASHING
from weightsvc.service.api import FileRange, Piece, Pull, PushHeader, PushMessage
from weightsvc.service.service import Service
from weightsvc.transport.auth import CALLER, peer_caller
from weightsvc.transport.body import ABORT, OFFLOAD, SENDFILE, Writer
from weightsvc.transport.limits import BodyBudget
from weightsvc.transport.push import Received, file_messages, framed_requests, push_messages
from weightsvc.transport.status import excerpt, http_domain_error, http_error

log = logging.getLogger("weightsvc.http")
# Pieces handed to the server per send: large enough to keep per-call overhead low, small enough
# to keep the event loop responsive.
PIECE_BYTES = 4 << 20
_RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$", re.ASCII)
_INT = re.compile(r"-?[0-9]{1,19}")
# The most a request body can need: an ack is a version and a client id; a selection names each
# tensor of the version once, its name JSON-escaped, with "@DIM:START:STOP" (at most 63 characters),
# quotes, a comma and some spaces.
ACK_BODY_BYTES = 4 << 10
SELECTOR_BYTES = 80
MISMATCH_BODY_BYTES = 256 << 10  # a report of up to MAX_REPORTED_VERSIONS versions
SELECTION_BODY_BYTES = 1 << 10  # beyond the selectors: {"select": [...]} and spaces
# The OpenAPI description of the streamed answers (what the fuzz tests and client generators read).
_DELTA: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "The delta encoding (proto: Delta)"}
}
_EVENTS: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "One event per version: id, event, data"}
}
_SELECT = (
    "A sliced pull: only these tensors, each `NAME` (whole) or `NAME@DIM:START:STOP` (the range [START, STOP) of "
    "dim DIM; split on the last '@'). The answer is a safetensors file of the selection, its manifest in __metadata__"
)
BIG_BODY = 1 << 20  # bytes: a body this large is parsed off the loop
KEEPALIVE_S = 15.0  # a comment on an idle watch stream: proxies and clients see it alive


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a single `bytes=` range; None for the whole file. ValueError if unsatisfiable.

    Several ranges, other units and syntactically invalid ranges are ignored (RFC 9110 §14.2):
    the whole file is sent.
    """
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if m is None:
        return None
    first, last = m.groups()
    if first == "":
        if last == "" or int(last) == 0:
            return None if last == "" else _unsatisfiable(header)
        return max(0, size - int(last)), size
    start = int(first)
    if last != "" and int(last) < start:
        return None
    if start >= size:
        _unsatisfiable(header)
    return start, size if last == "" else min(size, int(last) + 1)


def _unsatisfiable(header: str) -> tuple[int, int]:
    raise ValueError(header)


class PullResponse(Response):
    """Streams the pieces of a pull; releases the pull when done (also when the client goes away).
    Ranges of a version's file go out with the server's sendfile (`SENDFILE`)."""

    def __init__(self, pull: Pull, pieces: Iterator[Piece], status: int,
                 headers: dict[str, str]) -> None:
        m = pull.manifest
        headers = {"etag": pull.etag, "x-weightsvc-model": m.model, "x-weightsvc-version": str(m.version),
                   **headers}
        super().__init__(status_code=status, headers=headers, media_type="application/octet-stream")
        self.pull, self.pieces = pull, pieces

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extensions = scope.get("extensions") or {}
        try:
            # Every write under the stall timeout, the last one too: the server waits for a client's
            # window before it writes (uvicorn drains first), so any of them can wait forever.
            await self.pull.send(send({"type": "http.response.start", "status": self.status_code,
                                       "headers": self.raw_headers}))
            if scope.get("method") != "HEAD":
                offload = extensions.get(OFFLOAD)
                if offload is not None:
                    await self._offloaded(offload())
                else:
                    await self._on_loop(send, extensions.get(SENDFILE))
            await self.pull.send(send({"type": "http.response.body", "body": b"", "more_body": False}))
        except DeadlineExceeded as e:
            log.warning("HTTP %s", e.message)
            # The connection goes now: closed gracefully, it would first send what its buffer holds,
            # at the pace of the client that stopped reading, and hold on for as long.
            abort = extensions.get(ABORT)
            if abort is not None:
                abort()
        except ConnectionError:
            pass  # the client went away mid-pull (its connection is dropped): the pull ends here
        finally:
            self.pull.close()

    async def _offloaded(self, writer: Writer) -> None:
        """The body written by the writer threads: the loop only hands each piece over and waits."""
        await self.pull.send(writer.ready())
        try:
            for piece in self.pieces:
                await self.pull.send(writer.write(piece), len(piece))
        finally:
            writer.done()

    async def _on_loop(self, send: Send, sendfile: Any) -> None:
        # Zero-copy: the server's transport may keep views of what it could not send yet.
        self.pull.keep_buffer()
        for piece in self.pieces:
            if isinstance(piece, FileRange):
                await self.pull.send(sendfile(piece), piece.count)
                continue
            await self.pull.send(send({"type": "http.response.body", "body": piece, "more_body": True}), len(piece))


class AckBody(BaseModel):
    version: int
    client_id: str | None = None  # default: the peer's address, as gRPC's Ack


class LeaseBody(BaseModel):
    select: list[str] = Field([], description=_SELECT + " None: every tensor, whole.")
    lease_s: float = Field(DEFAULT_LEASE_S, description="How long the reader needs the version, in seconds (the "
                           "server caps it at --nixl-max-lease-s).")
    base: int | None = Field(None, ge=0, description="A version the reader holds: the delta encoding against it "
                             "is lent when there is one (not with `select`).")


class MismatchBody(BaseModel):
    """`{"versions": {"7": {"tokens": ..., "mean_abs_logp_delta": ..., "k3_kl": ..., "outside_band": ...,
    "band": [0.5, 2.0]}}, "step": 12}` (band optional: the default one): the fields are checked by the
    service, which names the version of a bad one."""

    versions: dict[str, dict[str, Any]]
    step: int | None = None  # the learner step that measured it


async def _events(watch: AsyncIterator[Manifest | None]) -> AsyncIterator[bytes]:
    """Server-sent events: one per version (id = the version, so a reconnect resumes after it), a
    comment when the watch has been idle."""
    try:
        async for manifest in watch:
            if manifest is None:
                yield b": keepalive\n\n"
            else:
                data = json.dumps(manifest.info(), separators=(",", ":"))
                yield f"id: {manifest.version}\nevent: version\ndata: {data}\n\n".encode()
    except Unavailable:
        return  # the server stops: the client reconnects (to another replica) with Last-Event-ID


class SelectBody(BaseModel):
    select: list[str] = Field(description=_SELECT)


BODY_SLICE = 1 << 20  # bytes of a big answer handed to the connection at once


async def _sliced(body: bytes) -> AsyncIterator[memoryview]:
    """A big answer (the manifest of 400,000 tensors: ~50 MB) in slices: handed over whole, what the
    socket does not take at once is copied into the connection's buffer in one call on the event loop
    (0.1 s), where a slice at a time waits for the socket between slices."""
    view = memoryview(body)
    for start in range(0, len(view), BODY_SLICE):
        yield view[start : start + BODY_SLICE]


def _json(m: Manifest) -> bytes:
    return m.json((",", ":")).encode()


def selection_body_bytes(m: Manifest) -> int:
    """The largest body a selection of version `m` can need (each tensor selected once, sliced)."""
    return SELECTION_BODY_BYTES + sum(len(json.dumps(t.name)) + SELECTOR_BYTES for t in m.tensors)


async def read_body(request: Request, cap: int, budget: BodyBudget, what: str) -> bytes:
    """The request's body, read only while it stays within `cap` bytes (413 before reading one that
    declares more) and within the budget of all bodies being read (429)."""
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isascii() and declared.isdigit() else None
    too_large = f"{what}: a body of %s bytes, more than the {cap} bytes it can need"
    if size is not None and size > cap:
        raise ResourceExhausted(too_large % size, reason="too_large")
    with budget.hold(what) as held:
        held.grow_to(size or 0)
        pieces, received = [], 0
        try:
            async for piece in request.stream():
                received += len(piece)
                if received > cap:
                    raise ResourceExhausted(too_large % f"over {received}", reason="too_large")
                held.grow_to(received)  # a chunked body: as it comes
                pieces.append(piece)
        except ClientDisconnect:  # gone, or too slow (`limits`): nobody reads the answer
            raise DeadlineExceeded(f"{what}: the client went away after {received} bytes of the body") from None
        return b"".join(pieces)


def parse_body(model: type[BaseModel], body: bytes, what: str) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise InvalidArgument(f"{what}: {problems}") from None


async def _until_gone(pieces: AsyncIterator[bytes], what: str) -> AsyncIterator[bytes]:
    """A push's body: a client that goes away (or is too slow, `limits`) aborts the push."""
    received = 0
    try:
        async for piece in pieces:
            received += len(piece)
            yield piece
    except ClientDisconnect:
        raise Aborted(f"{what}: the client went away after {received} bytes of the body", reason="aborted") from None


async def _of_model(messages: AsyncIterator[PushMessage], model: str) -> AsyncIterator[PushMessage]:
    """The messages of a push to the route of `model`: its header must name the same model."""
    async for m in messages:
        if isinstance(m, PushHeader) and m.model != model:
            raise InvalidArgument(f"the push to /v1/models/{model}/push has a header of model {m.model!r} "
                                  f"step {m.step}: push each model to its own route", reason="invalid_header")
        yield m


_PUSH_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary",
               "description": "PushRequest messages, each framed as gRPC frames it: a byte 0, a big-endian u32 "
                              "length, the serialized message"}}}}}
_FILE_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary", "description": "A safetensors file of F32 tensors"}}}}}


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its body itself (to bound it first)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def create_app(service: Service, *, is_ready: Any = lambda: True) -> FastAPI:
    app = FastAPI(title="weightsvc", version="1", docs_url="/docs", redoc_url=None)
    bodies = BodyBudget(service.settings.max_body_bytes, service.metrics.request_body_bytes)

    @app.exception_handler(WeightsvcError)
    async def _domain(_: Request, e: WeightsvcError) -> JSONResponse:
        return http_domain_error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if e.status_code == 404 else str(e.detail)
        return http_error(e.status_code, "NOT_FOUND" if e.status_code == 404 else "HTTP_ERROR", message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return http_error(500, "INTERNAL", f"internal error: {type(e).__name__}: {e}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return http_error(400, "INVALID_ARGUMENT", "; ".join(str(err.get("msg")) for err in e.errors()))

    def _damaged(model: str | None) -> list[dict[str, str]]:
        """The damaged files that restore set aside (of `model`, or of every model)."""
        return [dataclasses.asdict(d) for d in service.damaged_files(model)]

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if is_ready():
            return JSONResponse({"status": "ready", "device": service.device})
        return http_error(503, "UNAVAILABLE", "weightsvc is starting")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"models": [dataclasses.asdict(m) for m in service.models()], "damaged_files": _damaged(None)}

    @app.get("/v1/models/{model}/versions")
    async def versions(model: str) -> dict[str, Any]:
        listed = await service.listed_versions(model)
        versions = [m.info() if r is None else {**m.info(), "mismatch": r.mismatch.as_dict(), "mismatch_step": r.step}
                    for m, r in listed]
        return {"model": model, "versions": versions, "damaged_files": _damaged(model)}

    @app.post("/v1/models/{model}/mismatch", openapi_extra=_body_schema(MismatchBody))
    async def mismatch(model: str, request: Request) -> dict[str, Any]:
        """A learner's report of the trainer-rollout mismatch, per version (role push)."""
        what = f"the mismatch report of model {model!r}"
        body = parse_body(MismatchBody, await read_body(request, MISMATCH_BODY_BYTES, bodies, what), what)
        totals = await service.report_mismatch(model, body.versions, body.step)
        return {"model": model, "versions": {str(v): m.as_dict() for v, m in totals.items()}}

    @app.post("/v1/models/{model}/push", openapi_extra=_PUSH_BODY)
    async def push(model: str, request: Request) -> dict[str, Any]:
        """One rank's push stream, as gRPC's Push takes it (role push): the committed version."""
        body = Received(_until_gone(request.stream(), f"the push to model {model!r}"))
        requests = framed_requests(body, service.settings.max_message_bytes)
        return await _pushed(_of_model(push_messages(requests, service.settings.max_tensors), model))

    @app.put("/v1/models/{model}/versions/{step}/safetensors", openapi_extra=_FILE_BODY)
    async def push_file(model: str, step: int, request: Request, format: str = "", rounding: str = ""
                        ) -> dict[str, Any]:
        """A safetensors file of F32 masters as the version `step` (role push; `curl -T`): the committed
        version. `format` / `rounding` override the server's export, as a push's header does."""
        body = Received(_until_gone(request.stream(), f"the push of {subject(model, step=step)}"))
        return await _pushed(file_messages(body, model, step, format, rounding))

    @app.post("/v1/models/{model}/versions/{step}/publish")
    async def publish(model: str, step: int, request: Request) -> dict[str, Any]:
        """`serve --nixl`: a learner rank's publish, the JSON of gRPC's PublishRequest less model and step
        (`agent` in base64; role push): the committed version, once every rank is in and it is copied."""
        what = f"the publish of {subject(model, step=step)}"
        raw = await read_body(request, service.settings.max_message_bytes, bodies, what)
        try:
            body = await in_thread(len(raw) > BIG_BODY, json.loads, raw)
        except ValueError as e:
            raise InvalidArgument(f"{what}: the body is not JSON: {e}") from None
        published = await in_thread(len(raw) > BIG_BODY, publish_from_dict, model, step, body)
        manifest, created = await service.publish(published)
        return {**manifest.info(), "created": created}

    async def _pushed(messages: AsyncIterator[PushMessage]) -> dict[str, Any]:
        manifest, created = await service.push(messages)
        return {**manifest.info(), "created": created}

    @app.get("/v1/models/{model}/versions/{version}/manifest", response_model=None)
    async def manifest(model: str, version: str) -> Response:
        m = service.manifest(model, parse_version_ref(version))
        body = await off_loop(memo, m, "json", _json)
        if len(body) <= BODY_SLICE:
            return Response(body, media_type="application/json")
        return StreamingResponse(_sliced(body), media_type="application/json",
                                 headers={"content-length": str(len(body))})

    @app.head("/v1/models/{model}/versions/{version}/safetensors", response_model=None, operation_id="head_safetensors")
    @app.get("/v1/models/{model}/versions/{version}/safetensors", response_model=None, operation_id="get_safetensors")
    async def safetensors(
        model: str,
        version: str,
        request: Request,
        select: list[str] = Query([], description=_SELECT),
    ) -> Response:
        return await _file(model, version, request, select)

    @app.post("/v1/models/{model}/versions/{version}/safetensors", response_model=None,
              operation_id="post_safetensors_selection", openapi_extra=_body_schema(SelectBody))
    async def safetensors_selection(model: str, version: str, request: Request) -> Response:
        """The selection's file, as `GET ...?select=` answers it, for a selection too long for a URL
        (a tensor-parallel worker's slices of 100,000 tensors): the selectors in a JSON body."""
        m = service.manifest(model, parse_version_ref(version))
        what = f"the selection of {subject(model, m.version)}"
        cap = await off_loop(memo, m, "selection_body_bytes", selection_body_bytes)
        raw = await read_body(request, cap, bodies, what)
        body = await in_thread(len(raw) > BIG_BODY, parse_body, SelectBody, raw, what)
        if not body.select:
            raise InvalidArgument("the selection is empty: select at least one tensor")
        return await _file(model, version, request, body.select)

    async def _file(model: str, version: str, request: Request, select: list[str]) -> Response:
        selected = selection(map(parse_selector, select)) if select else None
        pull = await service.open_pull(model, parse_version_ref(version), "http", select=selected)
        try:
            span: tuple[int, int] | None = None
            size = pull.file_size
            if_range = request.headers.get("if-range")
            if if_range is None or if_range == pull.etag:  # a stale If-Range gets the whole new file
                span = _parse_range(request.headers.get("range"), size)
            start, end = span or (0, size)
            zero_copy = SENDFILE in (request.scope.get("extensions") or {})
            pieces = pull.file_pieces(start, end, PIECE_BYTES, zero_copy)
        except ValueError:
            pull.close()
            return http_error(
                416,
                "OUT_OF_RANGE",
                f"range {excerpt(request.headers.get('range') or '')} is outside the {size} bytes of "
                f"{subject(model, pull.manifest.version)}",
                {"content-range": f"bytes */{size}"},
            )
        except BaseException:
            pull.close()
            raise
        m, suffix = pull.manifest, "" if selected is None else "-selection"
        headers = {
            "content-length": str(end - start),
            "accept-ranges": "bytes",
            "content-disposition": f'attachment; filename="{m.model}-{m.version}{suffix}.safetensors"',
        }
        if span:
            headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
        return PullResponse(pull, pieces, 206 if span else 200, headers)

    @app.post("/v1/models/{model}/versions/{version}/lease", openapi_extra=_body_schema(LeaseBody))
    async def lease(model: str, version: str, request: Request) -> Response:
        """`serve --nixl`: lend the version (or the selection) to a reader that READs it over NIXL: the
        agent's metadata, the manifest and where each tensor lies, held until its release or deadline."""
        m = service.manifest(model, parse_version_ref(version))
        what = f"the lease of {subject(model, m.version)}"
        cap = await off_loop(memo, m, "selection_body_bytes", selection_body_bytes)
        raw = await read_body(request, cap, bodies, what)
        body = await in_thread(len(raw) > BIG_BODY, parse_body, LeaseBody, raw, what)
        selected = selection(map(parse_selector, body.select)) if body.select else None
        lent = await service.lease(model, m.version, selected, body.lease_s, body.base)
        answer = await off_loop(lambda _, lease: json.dumps(lease.to_dict()).encode(), lent.manifest, lent)
        return Response(answer, media_type="application/json")

    @app.delete("/v1/leases/{lease_id}", status_code=204)
    async def release_lease(lease_id: str) -> Response:
        """The reader is done with its lease: 504 when it expired first (what it read is not to be used)."""
        service.release_lease(lease_id)
        return Response(status_code=204)

    @app.get("/v1/models/{model}/versions/{version}/delta", response_model=None, responses=_DELTA)
    async def delta(model: str, version: str, base: int = Query(ge=0)) -> Response:
        pull = await service.open_pull(model, parse_version_ref(version), "http", base=base, dense_fallback=False)
        headers = {"content-length": str(len(pull.body)), "x-weightsvc-base-version": str(base)}
        return PullResponse(pull, (piece for _, piece in pull.chunks(0, PIECE_BYTES)), 200, headers)

    @app.get("/v1/models/{model}/watch", response_class=StreamingResponse, responses=_EVENTS)
    async def watch(
        model: str,
        after: int | None = None,
        last_event_id: str | None = Header(None, alias="last-event-id", description="counts as `after`"),
    ) -> StreamingResponse:
        if last_event_id:  # a reconnecting EventSource: it holds every version up to this one
            if not _INT.fullmatch(last_event_id.strip()):
                raise InvalidArgument(f"Last-Event-ID {last_event_id!r} is not a version number")
            after = int(last_event_id)
        events = _events(service.watch(model, after, idle=KEEPALIVE_S))
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    @app.post("/v1/models/{model}/acks", openapi_extra=_body_schema(AckBody))
    async def ack(model: str, request: Request) -> dict[str, int]:
        what = f"the ack of model {model!r}"
        body = parse_body(AckBody, await read_body(request, ACK_BODY_BYTES, bodies, what), what)
        peer = request.client
        client_id = body.client_id or (f"{peer.host}:{peer.port}" if peer else "")
        caller = request.scope.get(CALLER) or peer_caller(peer.host if peer else "")
        return {"latest_version": await service.ack(model, body.version, client_id, caller)}

    @app.get("/v1/topology")
    async def topology() -> dict[str, Any]:
        replicas = await service.topology()
        return {"replicas": [dataclasses.asdict(r) for r in replicas], "hashing": HASHING,
                "replication": service.settings.replication}

    @app.get("/v1/models/{model}/clients")
    async def clients(model: str) -> dict[str, Any]:
        statuses = service.clients(model)
        return {
            "model": model,
            "latest_version": service.manifest(model, None).version,
            "clients": [dataclasses.asdict(c) for c in statuses],
        }

    return app
