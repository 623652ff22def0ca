"""The one place a target picks its transport, for both client families: `InferenceClient(target)`
and `LearnerClient(target)` each make the client class of the target's transport, by its scheme."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Self

from weightsvc.errors import InvalidArgument

# Scheme -> transport; a target with none of these ("host:port") is gRPC.
SCHEMES = {"grpc://": "grpc", "grpcs://": "grpc", "http://": "http", "https://": "http", "s3://": "s3"}
DEFAULT = "grpc"
# How a user names each transport's target, for the error that refuses one.
GIVE = {"grpc": "host:port (or grpcs://host:port for TLS)", "http": "http://host:port (or https://)",
        "s3": "s3://BUCKET/PREFIX"}

# (family, transport) -> the family's class for it, loaded when first asked for: `weightsvc.client`
# registers them (each imports its family's base, so the base cannot import them).
_CLIENTS: dict[tuple[str, str], Callable[[], type[Any]]] = {}


def transport_of(target: str) -> str:
    """The transport `target` names by its scheme: "grpc", "http" or "s3"."""
    return next((t for scheme, t in SCHEMES.items() if target.startswith(scheme)), DEFAULT)


def register(family: str, **loaders: Callable[[], type[Any]]) -> None:
    """The classes of `family`, by transport: `register("learner", grpc=..., http=...)`."""
    _CLIENTS.update({(family, transport): load for transport, load in loaders.items()})


def client_class(family: str, target: str) -> type[Any]:
    """The class of `family` that speaks the transport `target` names."""
    transport = transport_of(target)
    load = _CLIENTS.get((family, transport))
    if load is None:
        offered = [t for f, t in _CLIENTS if f == family]
        raise InvalidArgument(f"{target}: a {family} client has no {transport} transport; give "
                              + " or ".join(GIVE[t] for t in offered))
    return load()


class ByTarget:
    """The base of a client family. Called with a target, the base makes the client of the target's
    transport (a subclass with its `transport` set); a subclass called by name is that transport's."""

    family: ClassVar[str]  # "inference" or "learner"
    transport: ClassVar[str] = ""  # "grpc", "http" or "s3": set by each transport's class

    def __new__(cls, target: str, *args: Any, **kwargs: Any) -> Self:
        if not cls.transport:
            cls = client_class(cls.family, target)
        return super().__new__(cls)
