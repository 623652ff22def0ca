"""Domain errors. Each class names its gRPC status code and its HTTP status; `transport.status` turns
them into what both transports answer, and the clients raise the same class again (`BY_GRPC_CODE`).

Messages name the model, version, tensor and the rule that was broken, the first three always the same
way (`subject`); `reason` is a short token from a fixed set, used as the label of the rejected-push metric.
"""

from __future__ import annotations


def subject(model: str, version: int | str | None = None, *, step: int | str | None = None,
            tensor: str | None = None, rank: int | None = None) -> str:
    """What a message is about, named the same way everywhere: `model 'policy' version 7 tensor 'w' rank 1`.
    A push in progress names its `step` (it is no version until it commits)."""
    out = f"model {model!r}"
    if version is not None:
        out += f" version {version}"
    if step is not None:
        out += f" step {step}"
    if tensor is not None:
        out += f" tensor {tensor!r}"
    if rank is not None:
        out += f" rank {rank}"
    return out


class WeightsvcError(Exception):
    grpc_code = "INTERNAL"
    http_status = 500

    def __init__(self, message: str, *, reason: str = "other") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason

    def __str__(self) -> str:
        return self.message


class InvalidArgument(WeightsvcError):
    grpc_code = "INVALID_ARGUMENT"
    http_status = 400


class NotFound(WeightsvcError):
    grpc_code = "NOT_FOUND"
    http_status = 404


class FailedPrecondition(WeightsvcError):
    grpc_code = "FAILED_PRECONDITION"
    http_status = 409


class AlreadyExists(WeightsvcError):
    grpc_code = "ALREADY_EXISTS"
    http_status = 409


class ResourceExhausted(WeightsvcError):
    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 413


class DiskFull(ResourceExhausted):
    """The data dir's disk (or quota) has no room for a file of `needed` bytes."""

    def __init__(self, message: str, *, needed: int, reason: str = "too_large") -> None:
        super().__init__(message, reason=reason)
        self.needed = needed


class TooManyRequests(ResourceExhausted):
    """A limit on streams in progress: retry later."""

    http_status = 429


class Unavailable(WeightsvcError):
    grpc_code = "UNAVAILABLE"
    http_status = 503


class Aborted(WeightsvcError):
    """A push given up: its stream ended without a commit or was cancelled, one of its ranks or parts
    failed, or the server stopped while staging it. Nothing was committed."""

    grpc_code = "ABORTED"
    http_status = 409


class DeadlineExceeded(WeightsvcError):
    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504


class Unauthenticated(WeightsvcError):
    grpc_code = "UNAUTHENTICATED"
    http_status = 401


class PermissionDenied(WeightsvcError):
    grpc_code = "PERMISSION_DENIED"
    http_status = 403


class Internal(WeightsvcError):
    """Something failed that is not the caller's doing: the message says what, and nothing was committed."""

    grpc_code = "INTERNAL"
    http_status = 500


class DataLoss(WeightsvcError):
    """The bytes received are not the bytes committed: a checksum did not match, or a stream, a delta or
    a stored manifest is not what it must be."""

    grpc_code = "DATA_LOSS"
    http_status = 500


BY_GRPC_CODE: dict[str, type[WeightsvcError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        AlreadyExists,
        ResourceExhausted,
        Unavailable,
        Internal,
        Aborted,
        DeadlineExceeded,
        Unauthenticated,
        PermissionDenied,
        DataLoss,
    )
}
