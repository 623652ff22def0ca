"""HTTP adapter (FastAPI): health, metrics, version lists, manifests and safetensors downloads."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from weightsvc.core.manifest import parse_version_ref
from weightsvc.core.service import Service
from weightsvc.core.store import CLIENT_TIMEOUT_S, Version
from weightsvc.core.topology import HASHING
from weightsvc.errors import WeightsvcError

log = logging.getLogger("weightsvc.http")
# Pieces handed to the server per send: large enough to keep per-call overhead low, small enough
# to keep the event loop responsive.
PIECE_BYTES = 4 << 20
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


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


def _holds(version: Version, start: int, end: int) -> bool:
    """Whether this server holds the bytes [start, end) of the version's file (a replica holding a
    part has the header and its part; they are contiguous only for the first part)."""
    head = len(version.header)
    lo, hi = (head + b for b in version.held)
    return end <= head or (lo <= start and end <= hi) or (lo == head and end <= hi)


class VersionFileResponse(Response):
    """Streams [start, end) of a version's safetensors file; releases the pull when done."""

    def __init__(self, service: Service, version: Version, start: int, end: int, status: int) -> None:
        m = version.manifest
        headers = {
            "content-length": str(end - start),
            "accept-ranges": "bytes",
            "etag": version.etag,
            "x-weightsvc-model": m.model,
            "x-weightsvc-version": str(m.version),
            "content-disposition": f'attachment; filename="{m.model}-{m.version}.safetensors"',
        }
        if status == 206:
            headers["content-range"] = f"bytes {start}-{end - 1}/{version.size}"
        super().__init__(status_code=status, headers=headers, media_type="application/octet-stream")
        self.service, self.version, self.start, self.end = service, version, start, end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = self.version.manifest
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope.get("method") != "HEAD":
                # Zero-copy: the server's transport may keep views of what it could not send yet
                # beyond this response, so the store never recycles this version's buffer.
                self.version.lent = True
                stall = self.service.settings.pull_stall_timeout_s
                for piece in self.version.file_range(self.start, self.end, PIECE_BYTES):
                    try:  # send waits on the transport's flow control: a client that reads nothing stalls it
                        async with asyncio.timeout(stall):
                            await send({"type": "http.response.body", "body": piece, "more_body": True})
                    except TimeoutError:
                        log.warning("model %s version %d: an HTTP client read nothing for %g s; pull dropped",
                                    m.model, m.version, stall)  # fmt: skip
                        return  # an incomplete response: the server closes the connection
                    self.service.count_pulled(m.model, "http", len(piece))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.service.close_pull(self.version, "http")


def create_app(service: Service, *, is_ready: Any = lambda: True) -> FastAPI:
    app = FastAPI(title="weightsvc", version="1", docs_url="/docs", redoc_url=None)

    @app.exception_handler(WeightsvcError)
    async def _domain(_: Request, e: WeightsvcError) -> JSONResponse:
        return _error(e.http_status, e.grpc_code, e.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if e.status_code == 404 else str(e.detail)
        return _error(e.status_code, "NOT_FOUND" if e.status_code == 404 else "HTTP_ERROR", message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error(500, "INTERNAL", f"internal error: {type(e).__name__}: {e}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, "INVALID_ARGUMENT", "; ".join(str(err.get("msg")) for err in e.errors()))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if is_ready():
            return JSONResponse({"status": "ready"})
        return _error(503, "UNAVAILABLE", "weightsvc is starting")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"models": [dataclasses.asdict(m) for m in service.models()]}

    @app.get("/v1/models/{model}/versions")
    async def versions(model: str) -> dict[str, Any]:
        return {"model": model, "versions": [m.info() for m in service.versions(model)]}

    @app.get("/v1/models/{model}/versions/{version}/manifest")
    async def manifest(model: str, version: str) -> dict[str, Any]:
        return service.manifest(model, parse_version_ref(version)).to_dict()

    @app.head("/v1/models/{model}/versions/{version}/safetensors", response_model=None, operation_id="head_safetensors")
    @app.get("/v1/models/{model}/versions/{version}/safetensors", response_model=None, operation_id="get_safetensors")
    async def safetensors(model: str, version: str, request: Request) -> Response:
        held = service.store.get(model, parse_version_ref(version))
        span: tuple[int, int] | None = None
        if_range = request.headers.get("if-range")
        if if_range is None or if_range == held.etag:  # a stale If-Range gets the whole new file
            try:
                span = _parse_range(request.headers.get("range"), held.size)
            except ValueError:
                resp = _error(
                    416,
                    "OUT_OF_RANGE",
                    f"range {request.headers.get('range')!r} is outside the {held.size} bytes of "
                    f"model {model!r} version {held.manifest.version}",
                )
                resp.headers["content-range"] = f"bytes */{held.size}"
                return resp
        start, end = span or (0, held.size)
        if held.part is not None and not _holds(held, start, end):
            owners = ", ".join(f"{p.owner} [{p.offset}, {p.offset + p.nbytes})" for p in held.manifest.parts)
            return _error(
                409,
                "FAILED_PRECONDITION",
                f"model {model!r} version {held.manifest.version} is sharded over replicas that each hold a part of "
                f"its data section ({owners}); this one serves its header ({len(held.header)} bytes) and its own "
                "part by Range. The InferenceClient gathers the parts from their owners",
            )
        # Held from here: the response releases it when it has sent its last byte.
        held = service.open_pull(model, held.manifest.version, "http")
        return VersionFileResponse(service, held, start, end, 206 if span else 200)

    @app.get("/v1/topology")
    async def topology() -> dict[str, Any]:
        replicas = await service.topology()
        return {"replicas": [dataclasses.asdict(r) for r in replicas], "hashing": HASHING}

    @app.get("/v1/models/{model}/clients")
    async def clients(model: str) -> dict[str, Any]:
        service.versions(model)  # 404 for an unknown model, as on every other model route
        horizon = time.time() - CLIENT_TIMEOUT_S
        return {
            "model": model,
            "latest_version": service.store.latest(model),
            "clients": [
                {
                    "client_id": c.client_id,
                    "version": c.version,
                    "lag_versions": service.store.versions_behind(model, c.version),
                    "last_seen_unix": c.acked_unix,
                    "connected": c.acked_unix >= horizon,
                }
                for c in service.clients(model)
            ],
        }

    return app
