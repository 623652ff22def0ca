"""Python clients: `LearnerClient` pushes fp32 masters, `InferenceClient` pulls served copies.

    LearnerClient("host:50051").push(step, model.state_dict())
    weights = InferenceClient("host:50051").pull()             # gRPC
    weights = InferenceClient("http://host:8080").pull()       # HTTP
    weights = InferenceClient("s3://bucket/prefix").pull()     # an object store, no server
    learner.report_mismatch(model, rollout_mismatch(learner_lp, engine_lp, versions, mask=mask), step=step)

The target picks the transport, one way for both (`_targets`): `InferenceClient(target)` is a
`GrpcInferenceClient`, an `HttpInferenceClient` or a `StoreInferenceClient`, and `LearnerClient(target)`
a `GrpcLearnerClient` or an `HttpLearnerClient`. Each inference client offers the pulls (whole, delta,
selected) and watch, the first two also what needs a server (acks, clients, topology). Every pulled tensor is verified
against the checksum in the version's manifest. Server errors arrive as `weightsvc.errors`
exceptions carrying the server's message.

Importing the clients imports neither torch nor numba: torch comes in with the first function
that builds torch tensors, and `LearnerClient.push` takes numpy arrays as well.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsvc.client._base import InferenceClient
from weightsvc.client._common import Credentials, Limits, RetryPolicy, VersionInfo, read_version_file, verify_data
from weightsvc.client._targets import register
from weightsvc.protocol.adapter import Adapter
from weightsvc.protocol.clients import ClientStatus as ClientInfo
from weightsvc.protocol.manifest import Slice
from weightsvc.protocol.mismatch import RolloutMismatch

if TYPE_CHECKING:
    from weightsvc.client._grpc import GrpcInferenceClient
    from weightsvc.client._http import HttpInferenceClient
    from weightsvc.client._learner import LearnerClient, Shard
    from weightsvc.client._learner_grpc import GrpcLearnerClient
    from weightsvc.client._learner_http import HttpLearnerClient
    from weightsvc.client._mismatch import rollout_mismatch
    from weightsvc.client._rank_lag import RankLag
    from weightsvc.client._store import StoreInferenceClient
    from weightsvc.client._tensors import dequantize, dequantized, served_weights, tensors_from_data

__all__ = [
    "Adapter",
    "ClientInfo",
    "Credentials",
    "GrpcInferenceClient",
    "GrpcLearnerClient",
    "HttpInferenceClient",
    "HttpLearnerClient",
    "InferenceClient",
    "LearnerClient",
    "Limits",
    "RankLag",
    "RetryPolicy",
    "RolloutMismatch",
    "Shard",
    "Slice",
    "StoreInferenceClient",
    "VersionInfo",
    "dequantize",
    "dequantized",
    "read_version_file",
    "rollout_mismatch",
    "served_weights",
    "tensors_from_data",
    "verify_data",
]

# Loaded on first use: the tensor functions import torch, the learner numpy, and a command that only
# asks a server for its status (`weightsvc status`) needs none of them.
_LAZY = {
    "GrpcInferenceClient": "_grpc",
    "GrpcLearnerClient": "_learner_grpc",
    "HttpInferenceClient": "_http",
    "HttpLearnerClient": "_learner_http",
    "LearnerClient": "_learner",
    "Shard": "_learner",
    "RankLag": "_rank_lag",
    "rollout_mismatch": "_mismatch",
    "StoreInferenceClient": "_store",
    "dequantize": "_tensors",
    "dequantized": "_tensors",
    "served_weights": "_tensors",
    "tensors_from_data": "_tensors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"weightsvc.client.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'weightsvc.client' has no attribute {name!r}")


def _lazy(name: str) -> Callable[[], type[Any]]:
    return lambda: __getattr__(name)


# Each family's client of each transport: `InferenceClient(target)` and `LearnerClient(target)` make
# the one of the target's (the transports import their family's base, so it cannot import them).
register("inference", grpc=_lazy("GrpcInferenceClient"), http=_lazy("HttpInferenceClient"),
         s3=_lazy("StoreInferenceClient"))
register("learner", grpc=_lazy("GrpcLearnerClient"), http=_lazy("HttpLearnerClient"))
