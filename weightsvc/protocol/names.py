"""The gRPC service, its methods and their shapes, in one place, read from the generated descriptor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from weightsvc.v1 import weightsvc_pb2 as pb

_DESCRIPTOR = pb.DESCRIPTOR.services_by_name["WeightService"]
SERVICE = _DESCRIPTOR.full_name


# Trailing metadata of an error answer: the error's reason (`WeightsvcError.reason`), so that a client
# tells a replica that answered UNAVAILABLE because the registry is away from one it cannot reach.
REASON_KEY = "weightsvc-reason"


def method(name: str) -> str:
    """The full gRPC method path of `name` (e.g. "Push" -> "/weightsvc.v1.WeightService/Push")."""
    return f"/{SERVICE}/{name}"


def handler_factory(request_streaming: bool, response_streaming: bool) -> Callable[..., grpc.RpcMethodHandler]:
    """grpc's constructor of method handlers of this streaming shape."""
    return {  # type: ignore[no-any-return]
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(request_streaming, response_streaming)]


class Method(NamedTuple):
    request: Any  # the generated message classes
    response: Any
    handler: Callable[..., grpc.RpcMethodHandler]


METHODS = {
    m.name: Method(getattr(pb, m.input_type.name), getattr(pb, m.output_type.name),
                   handler_factory(m.client_streaming, m.server_streaming))
    for m in _DESCRIPTOR.methods
}
PUSH = method("Push")
PULL = method("Pull")
