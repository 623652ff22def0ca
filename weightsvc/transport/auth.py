"""Who may do what: bearer tokens with roles, on gRPC metadata and the HTTP Authorization header.

Roles nest: `pull` reads (Pull, Watch, Ack, listings, every HTTP route but the pushes, the ack too), `push`
also pushes and publishes (a learner pulls its served copy back), `admin` may do everything. Tokens come from
`WEIGHTSVC_{PULL,PUSH,ADMIN}_TOKENS` (comma-separated) and/or `--auth-file` (JSON:
{"pull": [...], "push": [...], "admin": [...]}). Auth is on as soon as one token is configured.
Tokens are kept as SHA-256 digests and never logged; `/healthz`, `/readyz`, `/metrics` and the gRPC
health service stay open (`--auth-open-paths`), so probes and scrapers need no secret.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from weightsvc.errors import InvalidArgument, PermissionDenied, Unauthenticated
from weightsvc.protocol.names import PUSH, SERVICE, handler_factory, method
from weightsvc.transport.connections import parse_peer
from weightsvc.transport.status import grpc_status, http_domain_error

ROLES = ("pull", "push", "admin")  # each includes the ones before it
CALLER = "weightsvc.caller"  # the ASGI scope key where HttpAuth leaves `token_caller` of a request it let in
# gRPC methods that need more than `pull`; every other WeightService method needs `pull`.
METHOD_ROLES = {PUSH: "push", method("ReportMismatch"): "push", method("Publish"): "push"}
# HTTP routes that need more than `pull`: a learner's pushes, publishes and mismatch report.
_PUSH_ROUTES = {"POST": re.compile(r"/v1/models/[^/]+/(mismatch|push|versions/[^/]+/publish)"),
                "PUT": re.compile(r"/v1/models/[^/]+/versions/[^/]+/safetensors")}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def token_caller(authorization: str | None) -> str:
    """Who a request comes from, with auth on: its token (a digest, never the token). A client id
    belongs to the caller that acked under it first."""
    token = (authorization or "").partition(" ")[2].strip()
    return "token:" + hashlib.sha256(b"caller\0" + token.encode()).hexdigest()[:32]


def peer_caller(peer: str) -> str:
    """Who a request comes from, with auth off: its host (gRPC's "ipv4:10.0.0.7:53412" or HTTP's
    "10.0.0.7"), not its port, which changes with every connection."""
    address = parse_peer(peer)
    return "peer:" + (address[0] if address is not None else peer.removeprefix("unix:"))


def configured_tokens(env_tokens: Mapping[str, str | None], auth_file: Path | None) -> dict[str, list[str]]:
    """The tokens of each role, from the settings (comma-separated) and the auth file."""
    tokens: dict[str, list[str]] = {role: (env_tokens.get(role) or "").split(",") for role in ROLES}
    if auth_file is not None:
        try:
            listed = json.loads(auth_file.read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"--auth-file {auth_file}: {e}") from None
        if not isinstance(listed, dict) or not all(isinstance(v, list) for v in listed.values()):
            raise InvalidArgument(f'--auth-file {auth_file}: expected {{"pull": [...], "push": [...], ...}}')
        for role, values in listed.items():
            tokens.setdefault(role, []).extend(map(str, values))
    return tokens


class Auth:
    def __init__(self, tokens: Mapping[str, Iterable[str]]) -> None:
        self._roles: dict[bytes, int] = {}  # token digest -> highest role index
        for role, listed in tokens.items():
            if role not in ROLES:
                raise InvalidArgument(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
            for token in listed:
                if token.strip():
                    d = _digest(token.strip())
                    self._roles[d] = max(self._roles.get(d, 0), ROLES.index(role))

    @classmethod
    def load(cls, env_tokens: Mapping[str, str | None], auth_file: Path | None) -> Auth | None:
        """Tokens from the settings and the auth file; None when there are none (auth off)."""
        auth = cls(configured_tokens(env_tokens, auth_file))
        return auth if auth._roles else None

    def check(self, authorization: str | None, need: str, what: str) -> None:
        """Raise unless `authorization` ("Bearer <token>") carries a role of at least `need`."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(f"{what} needs a bearer token (role {need} or above)", reason="unauthenticated")
        role = self._roles.get(_digest(token.strip()))
        if role is None:
            raise Unauthenticated(f"{what}: the token is not valid here", reason="unauthenticated")
        if role < ROLES.index(need):
            raise PermissionDenied(
                f"{what} needs role {need}; this token has role {ROLES[role]}", reason="permission_denied"
            )


def _one(values: list[str], what: str) -> str | None:
    """The one authorization value of a request; several are refused rather than one of them picked."""
    if len(values) > 1:
        raise Unauthenticated(f"{what}: {len(values)} authorization values; send one bearer token",
                              reason="unauthenticated")
    return values[0] if values else None


# ---- gRPC ---------------------------------------------------------------------------------------


def _denied(handler: grpc.RpcMethodHandler, error: Unauthenticated | PermissionDenied,
            refused: Callable[[str], None] | None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that only answers with `error` (and, when the call
    failed authentication, has its connection closed by `refused`: it may not hold one)."""
    code = grpc_status(error)

    async def answer(context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        try:
            await context.abort(code, error.message)  # returns once the answer is sent, by raising
        finally:
            # Only now: a connection closed before its answer went out would leave the client guessing.
            if refused is not None and isinstance(error, Unauthenticated):
                refused(peer)

    async def unary(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await answer(context)

    async def streaming(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await answer(context)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    return handler_factory(handler.request_streaming, handler.response_streaming)(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class GrpcAuth(grpc.aio.ServerInterceptor):
    """Checks the `authorization` metadata of every WeightService call before its handler runs."""

    def __init__(self, auth: Auth, refused: Callable[[str], None] | None = None) -> None:
        self.auth = auth
        self.refused = refused  # called with the peer of a call that failed authentication

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith(f"/{SERVICE}/"):
            return handler  # the health service stays open
        values = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        name = method.rsplit("/", 1)[1]
        try:
            self.auth.check(_one(values, name), METHOD_ROLES.get(method, "pull"), name)
        except (Unauthenticated, PermissionDenied) as e:
            return _denied(handler, e, self.refused)
        return handler


# ---- HTTP ---------------------------------------------------------------------------------------


class HttpAuth:
    """ASGI middleware: every route needs role `pull` (a push or a mismatch report `push`) except the open paths."""

    def __init__(self, app: Any, auth: Auth, open_paths: Iterable[str]) -> None:
        self.app = app
        self.auth = auth
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        values = [v.decode("latin-1") for k, v in scope.get("headers") or () if k == b"authorization"]
        what = f"{scope['method']} {scope['path']}"
        try:
            value = _one(values, what)
            route = _PUSH_ROUTES.get(scope["method"])
            need = "push" if route is not None and route.fullmatch(scope["path"]) else "pull"
            self.auth.check(value, need, what)
        except (Unauthenticated, PermissionDenied) as e:
            # The connection goes with the answer: a client without a valid token may not hold one.
            headers = {"connection": "close"}
            if isinstance(e, Unauthenticated):
                headers["www-authenticate"] = 'Bearer realm="weightsvc"'
            await http_domain_error(e, headers)(scope, receive, send)
            return
        await self.app({**scope, CALLER: token_caller(value)}, receive, send)
