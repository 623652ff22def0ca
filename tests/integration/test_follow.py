"""`weightsvc follow` (a real process) against engines that cannot follow or answer badly: one that is
not there, one that takes the connection and never answers, one that trickles its answer, one that
answers nonsense, and strangers posting staging reports. Each is a clear, counted failure naming the
engine, retried; the follower stays up, and is not ready while it cannot follow. The engine is a small
real HTTP server that keeps a label and a pause as `vllm serve` does (real vLLM servers follow in
tests/engines)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ServeProcess, serving
from tests.helpers import closed_by_server, free_port
from weightsvc import LearnerClient
from weightsvc.server.server import BackgroundServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def service() -> Iterator[BackgroundServer]:
    with serving() as srv:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.randn(8, 8)}, model="policy")
        yield srv


class Engine:
    """The routes of `vllm serve` a follower drives, on 127.0.0.1 port 0: a `weight_version` label and a
    pause kept as vLLM keeps them, the transfer path's staging reported to the follower's notify URL as
    its workers would (`workers_report`). A route answers what a test put in `bad` (raw bytes, once
    each) before it answers well, and trickles its answer a byte at a time if it is in `trickle`."""

    def __init__(self, label: str = "1", *, workers_report: bool = True) -> None:
        self.label, self.paused, self.workers_report = label, False, workers_report
        self.bad: dict[str, list[bytes]] = {}
        self.trickle: set[str] = set()
        self.notify: str | None = None  # where the follower told the workers to report
        self.hung_up = threading.Event()  # a follower hung up on a trickled answer
        self.calls: collections.Counter[str] = collections.Counter()
        self._changed = threading.Condition()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._route(None)

            def do_POST(self) -> None:
                self._route(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}"))

            def _route(self, body: Any) -> None:
                route = self.path.partition("?")[0]
                with engine._changed:
                    engine.calls[route] += 1
                    engine._changed.notify_all()
                if engine.bad.get(route):
                    return self._send(200, engine.bad[route].pop(0))
                status, answer = engine.answer(route, body)
                self._send(status, json.dumps(answer).encode(), slowly=route in engine.trickle)

            def _send(self, status: int, data: bytes, slowly: bool = False) -> None:
                head = f"HTTP/1.0 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                whole = head.encode() + data
                if not slowly:
                    self.wfile.write(whole)
                    return
                try:
                    for i in range(len(whole)):  # (a byte each 0.1 s: well within any one read's timeout)
                        self.wfile.write(whole[i : i + 1])
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:
                    engine.hung_up.set()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def answer(self, route: str, body: Any) -> tuple[int, Any]:
        if route == "/weight_info":
            return 200, {"weight_version": self.label}
        if route == "/is_paused":
            return 200, {"is_paused": self.paused}
        if route == "/get_world_size":
            return 200, {"world_size": 1}
        if route in ("/pause", "/resume"):
            self.paused = route == "/pause"
        elif route == "/update_weight_version":
            self.label = body["new_version"]
        elif route == "/finish_weight_update" and body.get("weight_version"):
            self.label = body["weight_version"]
        elif route == "/init_weight_transfer_engine" and "stage" in body["init_info"]:
            self.notify = body["init_info"]["notify"]
            if self.workers_report:
                report = {"rank": 0, "model": "policy", "version": body["init_info"]["stage"], "pulled_bytes": 128,
                          "error": None}
                threading.Thread(target=self._report, args=(self.notify, report)).start()
            with self._changed:
                self._changed.notify_all()
        return 200, {}

    @staticmethod
    def _report(url: str, report: dict[str, Any]) -> None:
        """A worker's staging report; the follower may have ended with its test meanwhile, as a
        worker's follower can."""
        with contextlib.suppress(OSError):
            post(url, report)

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self._changed:
            assert self._changed.wait_for(predicate, 60), f"not within 60 s: {dict(self.calls)}"

    def __enter__(self) -> Engine:
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.shutdown()
        self.http.server_close()


class Follow:
    """A `weightsvc follow` process; its log lines (JSON) read as they come."""

    def __init__(self, engine: str, target: str, *args: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "weightsvc", "follow", "--engine", engine, "--target",
                                      target, "--model", "policy", "--listen", f"127.0.0.1:{port}", "--client-id",
                                      "f", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        """The next log line of event `name` (with `fields`), the lines before it passed over."""
        while True:
            try:
                e = self._lines.get(timeout=60)
            except queue.Empty:
                raise AssertionError(f"no {name} event within 60 s") from None
            if e is None:
                raise AssertionError(f"the follower ended ({self.proc.wait()}) before a {name} event: "
                                     f"{self.proc.stderr.read() if self.proc.stderr else ''}")
            if e["event"] == name and all(e.get(k) == v for k, v in fields.items()):
                return e

    def __enter__(self) -> Follow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        assert self.proc.wait(30) == 0, self.proc.stderr.read() if self.proc.stderr else ""


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: Any) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def failures(url: str, stage: str) -> float:
    line = next(line for line in get(f"{url}/metrics")[1].splitlines()
                if line.startswith(f'weightsvc_follower_failures_total{{stage="{stage}"}}'))
    return float(line.split()[-1])


def test_an_unreachable_engine_is_reported_and_retried(service: BackgroundServer) -> None:
    engine = f"http://127.0.0.1:{free_port()}"  # a port nothing listens on
    with Follow(engine, service.grpc_target) as follower:
        failed = follower.event("failed")
        assert failed["stage"] == "connect" and failed["engine"] == engine and failed["model"] == "policy"
        assert f"engine {engine}: GET /weight_info: unreachable" in str(failed["error"])
        status, body = get(f"{follower.url}/ready")
        assert status == 503 and "not connected" in body
        assert failures(follower.url, "connect") >= 1
        assert get(f"{follower.url}/healthz")[0] == 200
    assert service.service.clients("policy") == []


def test_an_engine_that_never_answers_is_timed_out(service: BackgroundServer) -> None:
    with socket.socket() as silent:  # accepts (the kernel's backlog), never reads, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        engine = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with Follow(engine, service.grpc_target, "--timeout-s", "0.5") as follower:
            failed = follower.event("failed")
    assert failed["stage"] == "connect"
    assert f"engine {engine}: GET /weight_info: no answer within 0.5 s" == failed["error"]


@pytest.mark.parametrize(("args", "message"), [
    (["--engine", "http://e:1", "--pause-mode", "later"], "'later' is not one of keep, wait, abort"),
    (["--engine", "e:1"], "'e:1' is not an http:// or https:// URL"),
    (["--engine", "http://e:1", "--listen", "nowhere"], "'nowhere' is not HOST:PORT"),
])
def test_bad_flags_are_one_line_errors(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "weightsvc", "follow", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 2 and message in done.stderr


DEEP = b"[" * 200_000 + b"]" * 200_000


@pytest.mark.parametrize(("label", "route", "answer", "message"), [
    ("1", "/weight_info", b"[1, 2]", "GET /weight_info answered '[1, 2]': not a JSON object with 'weight_version'"),
    ("1", "/weight_info", b"{}", "GET /weight_info answered '{}': not a JSON object with 'weight_version'"),
    ("1", "/weight_info", b'{"weight_version": "' + b"7" * 5000 + b'"}',
     "GET /weight_info answered weight_version '77777"),
    ("1", "/weight_info", b'{"weight_version": ' + b"7" * 5000 + b"}", "not a JSON object with 'weight_version'"),
    ("1", "/weight_info", '{"weight_version": "١٢"}'.encode(), "neither a version (ASCII digits"),
    ("1", "/weight_info", b'{"weight_version": {"v": 1}}', "not a JSON object with 'weight_version' of str or int"),
    ("1", "/weight_info", b"<html>busy</html>", "answered '<html>busy</html>': not a JSON object"),
    ("1", "/weight_info", DEEP, "answered '[[[["),
    ("weightsvc-updating-1", "/is_paused", b"{}", "GET /is_paused answered '{}': not a JSON object with 'is_paused'"),
    ("weightsvc-updating-1", "/is_paused", b'{"is_paused": "no"}', "with 'is_paused' of bool"),
    ("1", "/get_world_size", b'{"world_size": "2"}', "with 'world_size' of int"),
    ("1", "/get_world_size", b'{"world_size": 2.5}', "with 'world_size' of int"),
    ("1", "/get_world_size", b'{"world_size": true}', "with 'world_size' of int"),
    ("1", "/get_world_size", b'{"world_size": 0}', "world_size 0: not between 1 and 65536"),
])
def test_a_bad_engine_answer_is_logged_counted_and_retried(service: BackgroundServer, label: str, route: str,
                                                           answer: bytes, message: str) -> None:
    """The engine answers nonsense once, then well: the follower names the answer, counts it, asks
    again after its backoff and connects (it used to exit with a traceback)."""
    with Engine(label) as engine, Follow(engine.url, service.grpc_target) as follower:
        engine.bad[route] = [answer]
        failed = follower.event("failed")
        assert failed["stage"] == "connect" and message in failed["error"], failed
        assert failed["error"].startswith(f"engine {engine.url}: GET {route}") and len(failed["error"]) < 400
        connected = follower.event("connected")
        assert connected["served"] == label and connected["path"] == "transfer"
        assert failures(follower.url, "connect") == 1
        assert follower.proc.poll() is None


def test_an_engine_that_trickles_its_answer_is_cut_off_at_the_timeout(service: BackgroundServer) -> None:
    """A byte every 0.1 s keeps each read within any timeout: --timeout-s bounds the whole call."""
    with Engine() as engine, Follow(engine.url, service.grpc_target, "--timeout-s", "1") as follower:
        engine.trickle.add("/weight_info")
        failed = follower.event("failed")
        assert failed["stage"] == "connect"
        assert failed["error"] == f"engine {engine.url}: GET /weight_info: no answer within 1 s"
        assert engine.hung_up.wait(60)  # the follower hung up on the answer before its end


def test_staging_reports_come_only_from_the_engines_workers_for_the_version_staged() -> None:
    """/staged takes a report only at the URL the follower gave its engine's workers (a secret of this
    start), only for the version being staged and a rank of the engine's world; anything else is
    refused and not kept, and a peer that sends no body, or nothing at all, is cut off."""
    with serving() as srv:
        LearnerClient(srv.grpc_target).push(1, {"w": torch.randn(8, 8)}, model="policy")
        with Engine("0", workers_report=False) as engine, Follow(engine.url, srv.grpc_target) as follower:
            engine.wait_for(lambda: engine.notify is not None)  # staging version 1: the follower waits for rank 0
            notify = str(engine.notify)
            assert re.fullmatch(rf"{follower.url}/staged/[A-Za-z0-9_-]{{43}}", notify), notify
            report = {"rank": 0, "model": "policy", "version": 1, "pulled_bytes": 128, "error": None}
            for url in (f"{follower.url}/staged", f"{follower.url}/staged/guessed", f"{notify}x"):
                assert post(url, report)[0] == 403, url
            forged = [post(notify, {**report, "version": v})[0] for v in range(2, 2002)]
            assert forged == [409] * 2000  # versions not being staged: not kept
            for bad in ({**report, "rank": 1}, {**report, "rank": "0"}, {**report, "version": 10**30},
                        {**report, "pulled_bytes": -1}, {**report, "error": ["x"]}, [report], "report"):
                status, body = post(notify, bad)
                assert status == 400 and "bad staging report" in body, (bad, status, body)
            assert post(notify, {**report, "error": "x" * (20 << 10)})[0] == 413
            # Content-Length: -1 (a read until the peer closes, once) is refused at once, connections
            # and all; a peer that sends nothing is cut off after the server's 5 s.
            port = int(follower.url.rpartition(":")[2])
            socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(300)]
            for sock in socks:
                sock.sendall(f"POST {notify[len(follower.url):]} HTTP/1.1\r\nHost: f\r\n"
                             "Content-Length: -1\r\n\r\n".encode())
            assert all(closed_by_server(sock) for sock in socks)
            silent = socket.create_connection(("127.0.0.1", port), timeout=60)
            assert closed_by_server(silent)
            for sock in (*socks, silent):
                sock.close()
            # The workers' own report goes through: the version is swapped in and acked.
            assert post(notify, report) == (200, "{}")
            assert follower.event("update")["version"] == 1
            assert get(f"{follower.url}/ready")[0] == 200


def test_ready_is_503_while_the_weightsvc_server_does_not_answer() -> None:
    server = ServeProcess()
    try:
        LearnerClient(server.target).push(1, {"w": torch.randn(8, 8)}, model="policy")
        with Engine("1") as engine, Follow(engine.url, server.target, "--timeout-s", "2") as follower:
            follower.event("connected")
            assert get(f"{follower.url}/ready")[0] == 200
            server.kill()  # (the engine still serves the latest version the follower knows of)
            failed = follower.event("failed", stage="server")
            assert f"the weightsvc server {server.target} does not answer" in failed["error"]
            status, body = get(f"{follower.url}/ready")
            assert status == 503 and f"the weightsvc server {server.target} does not answer" in body
    finally:
        server.kill()
