"""The gRPC service and method names, in one place, read from the generated descriptor."""

from __future__ import annotations

from weightsvc.v1 import weightsvc_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["WeightService"].full_name


def method(name: str) -> str:
    """The full gRPC method path of `name` (e.g. "Push" -> "/weightsvc.v1.WeightService/Push")."""
    return f"/{SERVICE}/{name}"


PUSH = method("Push")
PULL = method("Pull")
