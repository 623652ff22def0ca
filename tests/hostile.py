"""Hostile servers: a gRPC and an HTTP server speaking weightsvc's protocol (the generated `weightsvc.v1`
stubs, the HTTP routes' paths) that answer whatever a test tells them: each model's version, its
manifest (altered at will: a model name with `../`, another version, absurd sizes) and its data. They
record what they were asked, so a test can wait on the calls it expects rather than sleep."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from weightsvc.protocol.manifest import Manifest, ServedTensor
from weightsvc.protocol.wire import manifest_to_proto
from weightsvc.v1 import weightsvc_pb2 as pb
from weightsvc.v1 import weightsvc_pb2_grpc as pb_grpc

CHUNK = 64 << 10


@dataclass(frozen=True)
class Served:
    """What a hostile server answers for one model: the version it announces, the manifest it sends
    for it and the data section that follows."""

    version: int
    manifest: Manifest
    data: bytes


def altered(template: Manifest, **changes: Any) -> Manifest:
    """`template` with `changes`; `tensor0={...}` alters its first tensor."""
    first = changes.pop("tensor0", None)
    m = dataclasses.replace(template, **changes)
    if first is not None:
        m = dataclasses.replace(m, tensors=(dataclasses.replace(m.tensors[0], **first), *m.tensors[1:]))
    return m


def claiming(template: Manifest, nbytes: int) -> Manifest:
    """`template` made a sound manifest of one BF16 tensor of `nbytes`: every size agrees (the data
    that follows is the template's, far shorter)."""
    t = ServedTensor("huge.weight", (nbytes // 2,), "BF16", 0, nbytes)
    return dataclasses.replace(template, tensors=(t,), data_bytes=t.nbytes, aliases=())


class _Recorder:
    def __init__(self, served: dict[str, Served], listed: list[str] | None) -> None:
        self.served = served
        self.listed = list(served) if listed is None else listed
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()  # (method, model) -> count
        self._changed = threading.Condition()

    def called(self, method: str, model: str = "") -> None:
        with self._changed:
            self.calls[method, model] += 1
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[collections.Counter[tuple[str, str]]], bool], timeout: float = 60) -> None:
        """Return once `predicate(calls)` holds; AssertionError after `timeout` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.calls), timeout):
                raise AssertionError(f"the calls expected did not come within {timeout} s: {dict(self.calls)}")

    def models(self, method: str) -> set[str]:
        with self._changed:
            return {model for (m, model), n in self.calls.items() if m == method and n}


class HostileGrpc(_Recorder, pb_grpc.WeightServiceServicer):
    """The gRPC one, on 127.0.0.1, port 0; `with HostileGrpc(...) as up: up.target`."""

    def __init__(self, served: dict[str, Served], listed: list[str] | None = None, threads: int = 64) -> None:
        """`threads`: calls answered at once (each watch held open takes one)."""
        super().__init__(served, listed)
        self.server = grpc.server(ThreadPoolExecutor(threads), options=[("grpc.max_send_message_length", 64 << 20)])
        pb_grpc.add_WeightServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    def __enter__(self) -> HostileGrpc:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0).wait()

    def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        self.called("ListModels")
        latest = {m: s.version for m, s in self.served.items()}
        return pb.ListModelsResponse(models=[pb.ModelSummary(model=m, latest_version=latest.get(m, 1),
                                                             versions=[latest.get(m, 1)]) for m in self.listed])

    def _info(self, model: str, s: Served) -> pb.VersionInfo:
        return pb.VersionInfo(model=model, version=s.version, format="bf16", rounding="sr",
                              tensor_count=len(s.manifest.tensors), data_bytes=s.manifest.data_bytes)

    def ListVersions(self, request: pb.ListVersionsRequest, context: Any) -> pb.ListVersionsResponse:
        self.called("ListVersions", request.model)
        s = self.served.get(request.model)
        return pb.ListVersionsResponse(versions=[self._info(request.model, s)] if s else [])

    def GetManifest(self, request: pb.GetManifestRequest, context: Any) -> pb.Manifest:
        self.called("GetManifest", request.model)
        return manifest_to_proto(self.served[request.model].manifest)

    def Watch(self, request: pb.WatchRequest, context: Any) -> Iterator[pb.VersionEvent]:
        self.called("Watch", request.model)
        s = self.served.get(request.model)
        if s is not None and (not request.HasField("after_version") or s.version > request.after_version):
            yield pb.VersionEvent(version=self._info(request.model, s))
        ended = threading.Event()
        context.add_callback(ended.set)  # held open, as a real server holds a watch, until the client goes
        ended.wait()

    def Pull(self, request: pb.PullRequest, context: Any) -> Iterator[pb.PullResponse]:
        self.called("Pull", request.model)
        s = self.served[request.model]
        yield pb.PullResponse(manifest=manifest_to_proto(s.manifest))
        for offset in range(request.offset, len(s.data), CHUNK):
            yield pb.PullResponse(chunk=pb.Chunk(offset=offset, data=s.data[offset : offset + CHUNK]))


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the clients under test hang up on what they refuse: that is the point, not an error


class HostileHttp(_Recorder):
    """The HTTP one (the manifest and safetensors routes), on 127.0.0.1, port 0; `up.url`."""

    _ROUTE = re.compile(r"/v1/models/([^/]+)/versions/([^/]+)/(manifest|safetensors)")

    def __init__(self, served: dict[str, Served]) -> None:
        super().__init__(served, None)
        self.event = b"event: version\ndata: {}\n\n"  # what a watch of any model is sent, then the stream ends
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                if self.path.split("?")[0].endswith("/watch"):
                    hostile.called("watch")
                    self._send(200, hostile.event)
                    return
                route = hostile._ROUTE.fullmatch(self.path)
                if route is None or route[1] not in hostile.served:
                    self._send(404, b'{"error": {"code": "NOT_FOUND", "message": "no such route"}}')
                    return
                hostile.called(route[3], route[1])
                s = hostile.served[route[1]]
                if route[3] == "manifest":
                    self._send(200, json.dumps(s.manifest.to_dict()).encode())
                else:
                    self._send(200, s.manifest.safetensors_header() + s.data)

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HostileHttp:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def established(port: int) -> int:
    """TCP connections established to 127.0.0.1:`port` (the server's side of each), from /proc/net/tcp
    and tcp6 (where a server may hold IPv4 connections as IPv4-mapped addresses)."""
    local = {f"0100007F:{port:04X}", f"0000000000000000FFFF00000100007F:{port:04X}"}
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            count += sum(1 for line in f if line.split()[1] in local and line.split()[3] == "01")
    return count
