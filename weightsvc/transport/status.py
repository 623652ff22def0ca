"""Errors on the wire, in one place: a domain error's gRPC status code, and the JSON error body of
every HTTP answer that is not a success (`{"error": {"code": ..., "message": ...}}`, the code being
gRPC's name for it, so clients of either transport raise the same exception)."""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from fastapi.responses import JSONResponse

from weightsvc.errors import WeightsvcError


def grpc_status(error: WeightsvcError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.grpc_code)  # type: ignore[no-any-return]


def http_error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def http_domain_error(error: WeightsvcError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return http_error(error.http_status, error.grpc_code, error.message, headers)


EXCERPT_CHARS = 64


def excerpt(text: str) -> str:
    """A request's value as an error message quotes it: the start of it, never all of a long one."""
    short = text if len(text) <= EXCERPT_CHARS else f"{text[:EXCERPT_CHARS]}... ({len(text)} characters)"
    return repr(short)
