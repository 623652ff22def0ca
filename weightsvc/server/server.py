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

from weightsvc.errors import WeightsvcError
from weightsvc.protocol.topology import REPLICA_TTL_S, Replica
from weightsvc.server.loop import monitor as loop_monitor
from weightsvc.server.relay import Relay
from weightsvc.service.publish import restore as restore_from_store
from weightsvc.service.service import Service
from weightsvc.settings import Settings
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
        self._grpc: grpc.aio.Server | None = None
        self._grpc_connections: GrpcConnections | None = None
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._relay: Relay | None = None
        self.replica: Replica | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None
        self._loop_monitor: asyncio.Task[None] | None = None

    @property
    def device(self) -> str:
        """Where pushes export (`Exporter.name`)."""
        return self.service.exporter.name if self.service is not None else ""

    @property
    def grpc_target(self) -> str:
        scheme = "grpcs://" if self.settings.tls_cert else ""
        return f"{scheme}{self.settings.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.settings.tls_cert else "http"
        return f"{scheme}://{self.settings.host}:{self.http_port}"

    async def start(self) -> None:
        s = self.settings
        _tune_process()
        self.service = Service(s)
        self._loop_monitor = asyncio.create_task(loop_monitor(self.service.metrics), name="loop-monitor")
        restored = await asyncio.to_thread(self.service.committer.restore)
        if restored:
            log.info("restored %d committed versions from %s", restored, s.data_dir)
        await self.service.committer.sync_registry()
        await self._start_publisher()
        auth = Auth.load(s.tokens(), s.auth_file)
        tls = (s.tls_cert.read_bytes(), s.tls_key.read_bytes()) if s.tls_cert and s.tls_key else None
        self._grpc_connections = GrpcConnections(s.max_connections, self._dropped_grpc)
        self._grpc, self.grpc_port = await start_grpc(self.service, s.host, s.grpc_port, auth=auth, tls=tls,
                                                      connections=self._grpc_connections)
        self._grpc_connections.start(self.grpc_port)
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when their protocol
        # says TCP, and without it a small response on a kept-alive connection waits ~40 ms (Nagle).
        sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((s.host, s.http_port))
        self.http_port = sock.getsockname()[1]
        app: Any = create_app(self.service, is_ready=lambda: self.ready)
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
        self._http = uvicorn.Server(config)
        config.load()
        # serve() would also install signal handlers; the CLI owns those, so drive the phases here.
        self._http.lifespan = config.lifespan_class(config)
        await self._http.startup(sockets=[sock])
        # uvicorn's tick loop (Date header, shutdown flag); we stop it through should_exit.
        self._http_task = asyncio.create_task(self._http.main_loop())
        if s.relay_from:
            self._relay = Relay(s.relay_from, self.service)
            self._relay.start()
        self.replica = self._describe()
        self.service.parts.replica_id = self.replica.id
        sharded = bool(s.redis_url) and not s.relay_from  # (a relay keeps a registry of its own)
        if sharded:
            await self.service.committer.follower.catch_up()  # before it takes part in pushes
        await self.service.registry.register(self.replica)
        if sharded:
            self.service.replica = self.replica  # (its registration vanishing tells a registry that lost its data)
        self._heartbeat = asyncio.create_task(self._renew(self.replica))
        if sharded:
            self._follow = asyncio.create_task(self.service.committer.follower.follow(), name="follow")
        self.ready = True
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

    async def _start_publisher(self) -> None:
        """--object-store: a server that starts with no versions (an empty or no data dir) first brings
        back those the store retains (not a sharded replica: it holds parts); one that has versions
        queues them (those in the store already are skipped); then uploads begin."""
        service = self.service
        assert service is not None
        if service.publisher is None:
            return
        await service.publisher.open()
        sharded = bool(self.settings.redis_url) and not self.settings.relay_from
        if not service.index.models() and not sharded:
            restored = await restore_from_store(service.publisher, self.settings, service.mirror)
            log.info("restored %d committed versions from the object store %s", restored, service.publisher.url)
        else:  # what the data dir holds and the store does not (uploads a stop or a crash cut off) goes up
            for model in service.index.models():
                for version in service.index.versions(model):
                    if version.part is None:
                        service.publisher.committed(version)
        service.publisher.start()

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

    async def _renew(self, replica: Replica) -> None:
        """Keep this replica's registration alive (it expires if the process dies)."""
        service = self.service
        while service is not None:
            await asyncio.sleep(REPLICA_TTL_S / 3)
            try:
                if not await service.registry.register(replica) and service.replica is not None:
                    service.registry_lost()  # it forgot this replica: it lost its data, or was away too long
                await service.topology()  # (kept fresh: what the topology was, should the registry lose it)
            except WeightsvcError as e:  # the registry is away: keep serving, try again
                log.warning("cannot renew replica %s: %s", replica.id, e)

    async def stop(self) -> None:
        self.ready = False
        for task in (self._heartbeat, self._follow, self._loop_monitor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.service is not None and self.replica is not None:
            self.service.replica = None  # (gone from the registry now, not to register again)
            with contextlib.suppress(WeightsvcError):
                await self.service.registry.deregister(self.replica.id)
        if self._relay is not None:
            await self._relay.stop()
        if self.service is not None:
            self.service.end_watches()  # open watch streams would hold up the HTTP server's shutdown
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await self._http_task
            await self._http.shutdown()
        if self._grpc_connections is not None:
            await self._grpc_connections.stop()
        if self._grpc is not None:
            await stop_grpc(self._grpc)
        if self.service is not None and self.service.publisher is not None:
            await self.service.publisher.stop()
        if self.service is not None:
            await asyncio.to_thread(self.service.close)
            await self.service.registry.close()


class BackgroundServer:
    """A Server on its own event-loop thread: for the demo, the bench and in-process tests.

    with BackgroundServer(Settings(grpc_port=0, http_port=0)) as srv:
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
