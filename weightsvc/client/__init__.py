"""Python clients: `LearnerClient` pushes fp32 masters, `InferenceClient` pulls served copies.

    LearnerClient("host:50051").push(step, model.state_dict())
    weights = InferenceClient("host:50051").pull()             # gRPC
    weights = InferenceClient("http://host:8080").pull()       # HTTP

`InferenceClient(target)` is a `GrpcInferenceClient` or an `HttpInferenceClient`, by the target;
both offer every operation (pulls, delta pulls, watch, ack). Every pulled tensor is verified
against the checksum in the version's manifest. Server errors arrive as `weightsvc.errors`
exceptions carrying the server's message.

Importing the clients imports neither torch nor numba: torch comes in with the first function
that builds torch tensors, and `LearnerClient.push` takes numpy arrays as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsvc.client._common import (
    ClientInfo,
    Credentials,
    InferenceClient,
    RetryPolicy,
    VersionInfo,
    read_version_file,
    verify_data,
)
from weightsvc.client._grpc import GrpcInferenceClient
from weightsvc.client._http import HttpInferenceClient
from weightsvc.client._learner import LearnerClient, Shard

if TYPE_CHECKING:
    from weightsvc.client._tensors import dequantized, served_weights, tensors_from_data

__all__ = [
    "ClientInfo",
    "Credentials",
    "GrpcInferenceClient",
    "HttpInferenceClient",
    "InferenceClient",
    "LearnerClient",
    "RetryPolicy",
    "Shard",
    "VersionInfo",
    "dequantized",
    "read_version_file",
    "served_weights",
    "tensors_from_data",
    "verify_data",
]

_TORCH = ("dequantized", "served_weights", "tensors_from_data")


def __getattr__(name: str) -> Any:
    # The functions that build torch tensors import torch: load them on first use.
    if name in _TORCH:
        from weightsvc.client import _tensors

        return getattr(_tensors, name)
    raise AttributeError(f"module 'weightsvc.client' has no attribute {name!r}")
