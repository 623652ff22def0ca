"""The HTTP inference client: `http://host:port` or `https://host:port`, the same operations as gRPC."""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from weightsvc.client._base import InferenceClient
from weightsvc.client._common import Progress, Receiver, VersionInfo, check_delta, patched, pull_parts
from weightsvc.errors import (
    BY_GRPC_CODE,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    WeightsvcError,
    subject,
)
from weightsvc.memory import alloc
from weightsvc.protocol.clients import ClientStatus
from weightsvc.protocol.fabric import Lease
from weightsvc.protocol.manifest import Manifest, manifest_from_header
from weightsvc.protocol.safetensors import MAX_HEADER_BYTES, header_length, read_safetensors_header
from weightsvc.protocol.selection import Select, selector
from weightsvc.protocol.topology import Replica

T = TypeVar("T")
MAX_EVENT_LINE = 64 << 10  # a version's event is a few hundred bytes of JSON
_quote = urllib.parse.quote
Origin = urllib.parse.SplitResult


class _Connections:
    """The keep-alive connections of one client, by origin; each serves one request at a time.

    Holds no reference to the client, so that the client's finalizer can close them."""

    def __init__(self, ca: bytes | None, timeout: float | None) -> None:
        self._ca, self._timeout = ca, timeout
        self._idle: dict[Origin, list[http.client.HTTPConnection]] = {}
        self._busy: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self._closed = False

    def take(self, origin: Origin) -> tuple[http.client.HTTPConnection, bool]:
        """A connection to `origin`, and whether it served a request before (it may have gone stale)."""
        with self._lock:
            idle = self._idle.get(origin)
            if idle:
                conn = idle.pop()
                self._busy.add(conn)
                return conn, True
        host = origin.hostname or "127.0.0.1"
        if origin.scheme == "https":
            context = ssl.create_default_context(cadata=self._ca.decode() if self._ca else None)
            conn = http.client.HTTPSConnection(host, origin.port, timeout=self._timeout, context=context)
        else:
            conn = http.client.HTTPConnection(host, origin.port, timeout=self._timeout)
        with self._lock:
            self._busy.add(conn)
        return conn, False

    def give(self, origin: Origin, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._busy.discard(conn)
            if not self._closed:
                self._idle.setdefault(origin, []).append(conn)
                return
        conn.close()  # a request that ended after the client was closed

    def drop(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()

    @property
    def opened(self) -> list[http.client.HTTPConnection]:
        with self._lock:
            return [*self._busy, *(c for idle in self._idle.values() for c in idle)]

    def close(self) -> None:
        """Close the idle connections; a busy one is shut down, which ends the read of the thread
        using it (a watch), and that thread closes it (closing it here would pull the response's
        file from under that read)."""
        with self._lock:
            self._closed = True
            idle, self._idle = [c for conns in self._idle.values() for c in conns], {}
            busy = list(self._busy)
        for conn in idle:
            conn.close()
        for conn in busy:
            if conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)


def _parsed(parse: Callable[[], T], where: str) -> T:
    """`parse()`, whose input came from the server: what it cannot read is DATA_LOSS."""
    try:
        return parse()
    except (KeyError, TypeError, ValueError, AttributeError, InvalidArgument) as e:
        raise DataLoss(f"{where}: the server's manifest cannot be read: {type(e).__name__}: {e}") from None


def _error(resp: http.client.HTTPResponse) -> WeightsvcError:
    """The domain error of an error response (`{"error": {"code", "message"}}`)."""
    body = resp.read()
    try:
        err = json.loads(body)["error"]
        code, message = err["code"], err["message"]
    except (ValueError, KeyError, TypeError):
        code, message = "UNKNOWN", body[:200].decode(errors="replace")
    e = BY_GRPC_CODE.get(code, WeightsvcError)(f"{code}: {message} (HTTP {resp.status})")
    e.grpc_code = code
    return e


class HttpInferenceClient(InferenceClient):
    """Pulls served copies over HTTP: `http://host:port`, or `https://host:port`."""

    transport = "http"

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._origin = urllib.parse.urlsplit(target)
        self._connections = _Connections(self.credentials.ca, self.timeout)
        self._owners: dict[str, str] = {}  # replica id -> HTTP URL, for the parts of sharded versions
        self._file_head: tuple[Manifest, int, str] | None = None  # of the sharded version being gathered
        self._own(self._connections.close)

    @contextlib.contextmanager
    def _open(self, method: str, path: str, *, headers: dict[str, str] | None = None, body: bytes | None = None,
              base: str | None = None) -> Iterator[http.client.HTTPResponse]:
        """The response to a request to `path` of the target (or of `base`, another replica's URL).

        Error statuses and lost connections are raised as domain errors; the connection is kept for
        the next request once the body has been read to its end."""
        origin = self._origin if base is None else urllib.parse.urlsplit(base)
        headers = dict(headers or {})
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.credentials.token:
            headers["Authorization"] = f"Bearer {self.credentials.token}"
        while True:
            conn, reused = self._connections.take(origin)
            try:
                conn.request(method, origin.path.rstrip("/") + path, body=body, headers=headers)
                resp = conn.getresponse()
                break
            except (OSError, http.client.HTTPException) as e:
                self._connections.drop(conn)
                if not reused:  # a kept connection the server has closed meanwhile: try a new one
                    raise Unavailable(f"UNAVAILABLE: {base or self.target}: {e}") from None
        done = False
        try:
            if resp.status >= 400:
                raise _error(resp)
            yield resp
            done = resp.isclosed() and not resp.will_close
        except (OSError, http.client.HTTPException) as e:
            raise Unavailable(f"UNAVAILABLE: {base or self.target}: {method} {path} broke off: {e!r}") from None
        finally:
            if done:
                self._connections.give(origin, conn)
            else:
                self._connections.drop(conn)

    def _json(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        """GET `path` (POST `payload`) and the JSON it answers (no larger than a version's header, the
        largest answer a server makes: a manifest)."""
        body = None if payload is None else json.dumps(payload).encode()
        with self._open("GET" if body is None else "POST", path, body=body) as resp:
            raw = resp.read(MAX_HEADER_BYTES + 1)
            if len(raw) > MAX_HEADER_BYTES:
                raise DataLoss(f"{self.target}: the answer to {path} is over {MAX_HEADER_BYTES} bytes")
            try:
                return json.loads(raw)
            except ValueError as e:
                raise DataLoss(f"{self.target}: the answer to {path} is not JSON: {e}") from None

    # ---- pulls ---------------------------------------------------------------------------------

    def _pull(
        self,
        model: str,
        version: str,
        held: tuple[Manifest, memoryview] | None,
        moved: Progress,
        *,
        select: Select | None = None,
        owner: str | None = None,
    ) -> tuple[Manifest, memoryview]:
        if held is not None:
            manifest = self.manifest(model, version)  # the number: the delta route takes no "latest"
            try:
                return manifest, self._pull_delta(manifest, held, moved)
            except FailedPrecondition:  # no delta (the base is gone, or it would not be smaller)
                version = str(manifest.version)
        manifest_of: list[Manifest] = []  # set by the first try; later ones resume the same version
        etag, start = "", 0
        rx: Receiver | None = None
        # A selection: a file of its own, of the selected tensors, POSTed (thousands of selectors do
        # not fit in a URL).
        method, body = "GET", None
        if select:
            method, body = "POST", json.dumps({"select": [selector(*s) for s in select.items()]}).encode()
        url = None if owner is None else self._owner_url(owner, subject(model, version))

        def attempt() -> None:
            nonlocal etag, start, rx
            path = f"/v1/models/{_quote(model)}/versions/{_quote(version)}/safetensors"
            if rx is None:
                # One request: the file's own header carries the manifest, so "latest" cannot
                # change under us.
                with self._open(method, path, body=body, base=url) as resp:
                    etag = resp.getheader("etag") or ""
                    head = resp.read(8)
                    if len(head) < 8 or (header_len := header_length(head)) > MAX_HEADER_BYTES:
                        raise DataLoss(f"{subject(model, version)}: not a safetensors stream")
                    where = subject(model, version)
                    start, header = _parsed(lambda: read_safetensors_header(head + resp.read(header_len)), where)
                    m = self.limits.check(_parsed(lambda: manifest_from_header(header), where), model, version)
                    manifest_of.append(m)
                    rx = Receiver(alloc(m.data_bytes), 0, m.data_bytes, moved, subject(model, m.version))
                    rx.read(resp)
                return
            # Resume the same version (If-Range: never splice two versions).
            path = f"/v1/models/{_quote(model)}/versions/{manifest_of[0].version}/safetensors"
            with self._open(method, path, headers={"Range": f"bytes={start + rx.pos}-", "If-Range": etag},
                            body=body, base=url) as resp:
                if resp.status != 206:
                    raise DataLoss(f"{rx.where} changed while resuming its pull")
                rx.read(resp)

        try:
            self.retry.run(attempt, resumable=lambda: rx is not None)
        except FailedPrecondition:  # a version of parts: no replica holds the whole file
            if select is not None:
                raise  # the caller pulls each owner's tensors from it
            sharded = self.manifest(model, version)
            if not sharded.parts:
                raise
            data = alloc(sharded.data_bytes)
            pull_parts(self.retry, sharded, data, 0, moved, self._pull_part)
            return sharded, data
        assert rx is not None
        return manifest_of[0], rx.data

    def _pull_delta(self, manifest: Manifest, held: tuple[Manifest, memoryview], moved: Progress) -> memoryview:
        """The data section of `manifest` from its delta on the held version; a break asks again."""
        path = f"/v1/models/{_quote(manifest.model)}/versions/{manifest.version}/delta?base={held[0].version}"
        where = f"{subject(manifest.model, manifest.version)} (delta on version {held[0].version})"

        def attempt() -> memoryview:
            with self._open("GET", path) as resp:
                got = (resp.getheader("x-weightsvc-version"), resp.getheader("x-weightsvc-base-version"))
                if got != (str(manifest.version), str(held[0].version)):
                    raise DataLoss(f"{where}: the server sent the delta of version {got[0]} on {got[1]}")
                size = resp.length
                if size is None:
                    raise DataLoss(f"{where}: the delta came without a length")
                check_delta(manifest, size, where)
                rx = Receiver(alloc(size), 0, size, moved, where)
                rx.read(resp)
                return rx.data

        return patched(manifest, held, self.retry.run(attempt))

    def _owner_url(self, owner: str, where: str) -> str:
        """The HTTP URL of the replica `owner` (the topology is asked for again once if it is not known)."""
        if owner not in self._owners:
            self._owners = {r.id: r.http for r in self.topology()}
        if owner not in self._owners:
            raise Unavailable(f"{where}: replica {owner!r} is not in the topology (it is down or has left)")
        return self._owners[owner]

    def _pull_part(self, manifest: Manifest, source: str, rx: Receiver) -> None:
        head, etag = self._head_of(manifest)
        with self._open(
            "GET",
            f"/v1/models/{_quote(manifest.model)}/versions/{manifest.version}/safetensors",
            headers={"Range": f"bytes={head + rx.pos}-{head + rx.end - 1}", "If-Range": etag},
            base=self._owner_url(source, rx.where),
        ) as resp:
            if resp.status != 206:
                raise DataLoss(f"{rx.where}: the replica did not answer with its part")
            rx.read(resp)

    def _head_of(self, manifest: Manifest) -> tuple[int, str]:
        """The length and ETag of `manifest`'s file header: built once per version (a large model's
        header runs to megabytes), not once per part and retry."""
        cached = self._file_head
        if cached is None or cached[0] is not manifest:
            header = manifest.safetensors_header()
            cached = self._file_head = (manifest, len(header), manifest.etag(header))
        return cached[1], cached[2]

    # ---- metadata ------------------------------------------------------------------------------

    def manifest(self, model: str = "default", version: int | str = "latest") -> Manifest:
        got = self._json(f"/v1/models/{_quote(model)}/versions/{_quote(str(version))}/manifest")
        return self.limits.check(_parsed(lambda: Manifest.from_dict(got), subject(model, version)),
                             model, version)

    def versions(self, model: str = "default") -> list[VersionInfo]:
        return [VersionInfo.from_dict(v) for v in self._json(f"/v1/models/{_quote(model)}/versions")["versions"]]

    def models(self) -> list[dict[str, Any]]:
        return list(self._json("/v1/models")["models"])

    def damaged_files(self) -> list[dict[str, str]]:
        return list(self._json("/v1/models").get("damaged_files", []))

    def topology(self) -> list[Replica]:
        return [Replica(**r) for r in self._json("/v1/topology")["replicas"]]

    def clients(self, model: str = "default") -> list[ClientStatus]:
        return [ClientStatus(**c) for c in self._json(f"/v1/models/{_quote(model)}/clients")["clients"]]

    # ---- leases over NIXL ----------------------------------------------------------------------

    def _lease(self, model: str, version: str, select: Select | None, lease_s: float,
               base: int | None = None) -> Lease:
        where = subject(model, version)
        body: dict[str, Any] = {"lease_s": lease_s}
        if select is not None:
            body["select"] = [selector(name, cut) for name, cut in select.items()]
        if base is not None:
            body["base"] = base
        got = self._json(f"/v1/models/{_quote(model)}/versions/{_quote(version)}/lease", body)
        lease = Lease.from_dict(got if isinstance(got, dict) else {}, where)
        self.limits.check(lease.manifest, model, version)
        return lease

    def _release(self, lease_id: str) -> None:
        with self._open("DELETE", f"/v1/leases/{_quote(lease_id)}") as resp:
            resp.read()

    # ---- watch and ack -------------------------------------------------------------------------

    def _events(self, model: str, after: int | None) -> Iterator[VersionInfo]:
        """Server-Sent Events: `id: <version>`, `event: version`, `data: <the version's JSON>`."""
        path = f"/v1/models/{_quote(model)}/watch"
        headers = {"Accept": "text/event-stream"}
        if after is not None:
            path += f"?after={after}"
            headers["Last-Event-ID"] = str(after)
        with self._open("GET", path, headers=headers) as resp:
            event, data = "message", list[bytes]()
            while line := resp.readline(MAX_EVENT_LINE + 1):
                if len(line) > MAX_EVENT_LINE or len(data) > 64:
                    raise DataLoss(f"{self.target}: the watch of model {model!r} sent an event over {MAX_EVENT_LINE} "
                                   "bytes a line or 64 lines")
                line = line.rstrip(b"\r\n")
                if not line:  # a blank line ends an event
                    if event == "version" and data:
                        yield VersionInfo.from_dict(json.loads(b"\n".join(data)))
                    event, data = "message", list[bytes]()
                elif not line.startswith(b":"):  # ": keepalive" and other comments carry nothing
                    name, _, value = line.partition(b":")
                    value = value.removeprefix(b" ")
                    if name == b"event":
                        event = value.decode()
                    elif name == b"data":
                        data.append(value)

    def _ack(self, model: str, version: int, client_id: str) -> int:
        reply = self._json(f"/v1/models/{_quote(model)}/acks", {"version": version, "client_id": client_id})
        return int(reply["latest_version"])


def post_framed(client: HttpInferenceClient, path: str, messages: Iterable[Sequence[bytes | memoryview]]) -> Any:
    """POST a body of messages (each given in pieces), framed as gRPC frames them, in chunked
    transfer encoding, and the JSON answer. Each piece is written as it is (no copy of a
    tensor's bytes); an answer that comes before the body is all sent (a refusal) ends the sending."""
    origin = client._origin
    conn, reused = client._connections.take(origin)
    if reused:  # a stream cannot be sent again on a new connection if a kept one went stale
        client._connections.drop(conn)
        conn, _ = client._connections.take(origin)
    done = False
    try:
        try:
            conn.putrequest("POST", origin.path.rstrip("/") + path, skip_accept_encoding=True)
            headers = {"Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"}
            if client.credentials.token:
                headers["Authorization"] = f"Bearer {client.credentials.token}"
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            sock = conn.sock
            # (over TLS the server sends session tickets: readable says nothing; a refusal shows as
            # the connection closing under the writes)
            early = not isinstance(sock, ssl.SSLSocket)
            end = b""  # the end of the previous message's chunk, sent with the next one's start
            for pieces in messages:
                if early and select.select([sock], [], [], 0)[0]:
                    break  # the server answered already (or closed): read why
                n = sum(map(len, pieces))
                head = b"%s%x\r\n\x00%s" % (end, n + 5, n.to_bytes(4, "big"))
                first, *rest = pieces
                if len(first) <= 1 << 16:  # the framing of a chunk, or a small message: one write
                    sock.sendall(head + first)
                else:
                    sock.sendall(head)
                    sock.sendall(first)
                for piece in rest:
                    sock.sendall(piece)
                end = b"\r\n"
            else:
                sock.sendall(end + b"0\r\n\r\n")
        except OSError:
            pass  # the server may have answered before it closed: read it
        try:
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            raise Unavailable(f"UNAVAILABLE: {client.target}: POST {path} broke off: {e!r}") from None
        if resp.status >= 400:
            raise _error(resp)
        try:
            answer = json.loads(resp.read())
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise Unavailable(f"UNAVAILABLE: {client.target}: POST {path}: no answer: {e!r}") from None
        done = resp.isclosed() and not resp.will_close
        return answer
    finally:
        if done:
            client._connections.give(origin, conn)
        else:
            client._connections.drop(conn)
