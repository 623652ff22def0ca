"""Runs the core with its two transports (gRPC and HTTP) on one event loop.

Nothing heavy runs on the loop: exports, checksums and file writes go to threads, so one process
serves both protocols.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import resource
import socket
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import uvicorn

from weightsvc.protocol.topology import Replica
from weightsvc.server.gather import Gatherer
from weightsvc.server.loop import monitor as loop_monitor
from weightsvc.server.probes import Probes
from weightsvc.server.relay import Relay
from weightsvc.service.service import Service
from weightsvc.settings import Settings
from weightsvc.transport._internals import start_uvicorn, stop_uvicorn
from weightsvc.transport.auth import Auth, HttpAuth
from weightsvc.transport.body import Sendfile
from weightsvc.transport.connections import GrpcConnections
from weightsvc.transport.grpc import start_grpc, stop_grpc
from weightsvc.transport.http import create_app
from weightsvc.transport.limits import limited_http

log = logging.getLogger("weightsvc.server")
T = TypeVar("T")
SWITCH_INTERVAL_S = 0.0005
_M_ARENA_MAX = -8  # glibc malloc.h


def _tune_process() -> None:
    # The loop thread hands the GIL to the export thread at every kernel and checksum call;
    # CPython's default 5 ms switch interval would stall each hand-off (measured: push 3x slower).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Chunks are allocated on one thread and freed on another; glibc's per-thread arenas then keep
    # freed chunks resident (measured: about 90 MiB less peak RSS with two arenas).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 2)
    # Every connection and version file is a descriptor: take as many as the system allows.
    with contextlib.suppress(OSError, ValueError):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Server:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.service: Service | None = None
        self.ready = False
        self.grpc_port = 0
        self.http_port = 0
        self.probe_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._grpc_connections: GrpcConnections | None = None
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._relay: Relay | None = None
        self._gather = Gatherer(settings)  # sharded replicas with --object-store: a version whole, for the store
        self.replica: Replica | None = None
        self._loop_monitor: asyncio.Task[None] | None = None
        self._probes = Probes()

    @property
    def device(self) -> str:
        """Where pushes export (`Service.device`)."""
        return self.service.device if self.service is not None else ""

    @property
    def grpc_target(self) -> str:
        scheme = "grpcs://" if self.settings.tls_cert else ""
        return f"{scheme}{self.settings.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.settings.tls_cert else "http"
        return f"{scheme}://{self.settings.host}:{self.http_port}"

    @property
    def probe_url(self) -> str:
        """Where /healthz and /readyz are answered off the event loop (plain HTTP)."""
        return f"http://{self.settings.host}:{self.probe_port}"

    async def start(self) -> None:
        s = self.settings
        _tune_process()
        self.service = Service(s, self._gather)
        self._probes.turned()
        self._loop_monitor = asyncio.create_task(loop_monitor(self.service.metrics, self._probes.turned),
                                                 name="loop-monitor")
        # First: the probes answer while it starts (restoring a data dir can take a while).
        self.probe_port = self._probes.start(s.host, s.probe_port, self.service.device, s.loop_wedged_s)
        await self.service.start(self._listen)  # the start-up order is the service's
        self.ready = True
        self._probes.ready(True)
        log.info(
            "weightsvc serving grpc=%s http=%s format=%s rounding=%s retain=%d data_dir=%s relay_from=%s",
            self.grpc_target,
            self.http_url,
            s.format,
            s.rounding,
            s.retain,
            s.data_dir,
            s.relay_from,
        )
        log.info("probes (off the event loop) at %s", self.probe_url)

    async def _listen(self) -> Replica:
        """Serve both transports (and relay, with --relay-from): this replica, as clients reach it."""
        s = self.settings
        service = self.service
        assert service is not None
        auth = Auth.load(s.tokens(), s.auth_file)
        tls = (s.tls_cert.read_bytes(), s.tls_key.read_bytes()) if s.tls_cert and s.tls_key else None
        self._grpc_connections = GrpcConnections(s.max_connections, self._dropped_grpc)
        self._grpc, self.grpc_port = await start_grpc(service, s.host, s.grpc_port, auth=auth, tls=tls,
                                                      connections=self._grpc_connections)
        self._grpc_connections.start(self.grpc_port)
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when their protocol
        # says TCP, and without it a small response on a kept-alive connection waits ~40 ms (Nagle).
        sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((s.host, s.http_port))
        self.http_port = sock.getsockname()[1]
        app: Any = create_app(service, is_ready=lambda: self.ready)
        if auth is not None:
            app = HttpAuth(app, auth, [p for p in s.auth_open_paths.split(",") if p])
        app = Sendfile(app)  # outermost: it reaches uvicorn's connection
        config = uvicorn.Config(
            app,
            ssl_certfile=s.tls_cert,
            ssl_keyfile=s.tls_key,
            http=limited_http(s.max_connections, s.connect_timeout_s, self._dropped_http),
            lifespan="off",
            log_config=None,
            access_log=False,
        )
        self._http, self._http_task = await start_uvicorn(config, sock)
        if s.relay_from:
            self._relay = Relay(s.relay_from, service)
            self._relay.start()
        self.replica = self._describe()
        self._gather.serving(self.replica)
        return self.replica

    def _dropped_http(self, reason: str) -> None:
        if self.service is not None:
            self.service.metrics.connections_dropped.labels("http", reason).inc()

    def _dropped_grpc(self, reason: str) -> None:
        if self.service is not None:
            self.service.metrics.connections_dropped.labels("grpc", reason).inc()

    def _describe(self) -> Replica:
        """This replica as clients reach it."""
        s = self.settings
        host = s.advertise_host or (socket.gethostname() if s.host in ("0.0.0.0", "::", "") else s.host)
        host = f"[{host}]" if ":" in host else host
        scheme = "grpcs://" if s.tls_cert else ""
        http = "https" if s.tls_cert else "http"
        replica_id = s.replica_id or f"{socket.gethostname()}-{self.grpc_port}"
        return Replica(replica_id, f"{scheme}{host}:{self.grpc_port}", f"{http}://{host}:{self.http_port}")

    async def stop(self) -> None:
        self.ready = False
        self._probes.ready(False)
        if self._loop_monitor is not None:
            self._loop_monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_monitor
        if self.service is not None:
            await self.service.stop(self._close)  # the order it goes down in is the service's
        self._probes.stop()

    async def _close(self) -> None:
        """Stop relaying and serving: what `_listen` started, in reverse."""
        self._gather.close()
        if self._relay is not None:
            await self._relay.stop()
        if self._http is not None and self._http_task is not None:
            await stop_uvicorn(self._http, self._http_task)
        if self._grpc_connections is not None:
            await self._grpc_connections.stop()
        if self._grpc is not None:
            await stop_grpc(self._grpc)


class BackgroundServer:
    """A Server on its own event-loop thread: for the demo, the bench and in-process tests.

    with BackgroundServer(Settings(grpc_port=0, http_port=0, probe_port=0)) as srv:
        LearnerClient(srv.grpc_target).push(...)
    """

    def __init__(self, settings: Settings) -> None:
        self.server = Server(settings)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="weightsvc-loop", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        self.call(self.server.start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self.server.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    @property
    def service(self) -> Service:
        assert self.server.service is not None
        return self.server.service

    @property
    def grpc_target(self) -> str:
        return self.server.grpc_target

    @property
    def http_url(self) -> str:
        return self.server.http_url
