"""`weightsvc follow`: the sidecar that keeps a `vllm serve` engine on the latest version of a model
(`weightsvc.integrations.vllm.follower`), with its own small HTTP server: `/metrics`
(`weightsvc_follower_*`), `/ready` (200 while the engine serves the latest version within
`--max-lag` and its weightsvc server answers, else 503; with `--max-live`, also the live revisions),
`/healthz`, and `/staged/SECRET`, where the engine's workers say a version is staged. SECRET is made
at each start and reaches the workers only in the notify URL the follower gives them through its
engine: a report from anyone else is refused (403). The server is small and bounded (`SmallHttpServer`):
32 connections at once, 5 s for each request."""

from __future__ import annotations

import hmac
import json
import secrets
import signal
import socket
import tempfile
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Annotated, Any

import typer

from weightsvc._small_http import SmallHttpServer
from weightsvc.cli._common import DEFAULT_TARGET, CaCert, Token, fail, one_source, say

MAX_REPORT_BYTES = 16 << 10  # a staging report: a rank, a version, a byte count and an error message


def follow(
    ctx: typer.Context,
    engine: Annotated[str, typer.Option(help="The vLLM server's base URL, e.g. http://127.0.0.1:8000.")],
    model: Annotated[str, typer.Option(help="Model name in weightsvc.")] = "default",
    target: Annotated[str, typer.Option(envvar="WEIGHTSVC_TARGET", help="weightsvc gRPC HOST:PORT.")] = DEFAULT_TARGET,
    url: Annotated[str | None, typer.Option(help="weightsvc HTTP base URL (instead of --target).")] = None,
    max_lag: Annotated[int, typer.Option(min=0, help="/ready answers 200 while the engine is at most this many "
                                                     "versions behind the latest.")] = 0,
    pause_mode: Annotated[str, typer.Option(help="How the engine pauses for a swap: keep (requests in flight "
                                                 "wait, then go on), wait (they finish first), abort.")] = "keep",
    listen: Annotated[str, typer.Option(help="HOST:PORT of the follower's own HTTP server (/metrics, /ready, "
                                             "/staged, which the engine's workers reach); port 0 picks one.")
                      ] = "127.0.0.1:9401",
    notify: Annotated[str | None, typer.Option(help="The URL the engine's workers reach this follower's /staged "
                                                    "at (default: http://LISTEN/staged).")] = None,
    client_id: Annotated[str | None, typer.Option(help="The id the follower acks under (default: the host name "
                                                       "and the engine's port).")] = None,
    path: Annotated[str, typer.Option(help="auto: vLLM's weight-transfer API with the weightsvc backend where the "
                                           "engine has it, else /collective_rpc with the worker extension.")] = "auto",
    timeout_s: Annotated[float, typer.Option(min=0.1, help="Timeout of each engine call (the whole call) and of "
                                                           "each call to the weightsvc server.")] = 30.0,
    update_timeout_s: Annotated[float, typer.Option(min=1, help="Timeout of staging and of the swap.")] = 600.0,
    dequantize: Annotated[bool, typer.Option(help="Load fp8 versions as values (an engine in bf16).")] = False,
    max_live: Annotated[int, typer.Option(min=0, help="Follow a LoRA adapter model: load each version as the "
                                                      "adapter MODEL@vN (engine with --enable-lora) and keep the "
                                                      "newest this many loaded; 0: a full model, swapped in place.")
                        ] = 0,
    adapter_dir: Annotated[Path | None, typer.Option(help="With --max-live: where each loaded revision's files "
                                                          "lie (the engine reads them; default: a directory "
                                                          "under the system's temp dir).")] = None,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Keep a vLLM server (vllm serve) on the latest version: stage, pause, swap, resume, ack."""
    one_source(ctx, url)
    from weightsvc.integrations.vllm.follower import PATHS, PAUSE_MODES, Follower, FollowerConfig
    from weightsvc.metrics import FollowerMetrics

    for flag, value, choices in (("--pause-mode", pause_mode, PAUSE_MODES), ("--path", path, PATHS)):
        if value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=flag)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise typer.BadParameter(f"{listen!r} is not HOST:PORT", param_hint="--listen")
    if not engine.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{engine!r} is not an http:// or https:// URL", param_hint="--engine")

    metrics = FollowerMetrics()
    try:
        http = SmallHttpServer((host, int(port)), _Handler)
    except OSError as e:
        fail(f"cannot listen on {listen}: {e}")
    secret = secrets.token_urlsafe(32)
    bound = f"{host}:{http.server_address[1]}"
    local = f"127.0.0.1:{http.server_address[1]}" if host in ("0.0.0.0", "::", "") else bound  # (the workers are local)
    engine_port = engine.rstrip("/").rpartition(":")[2]
    staged_at = notify or f"http://{local}/staged"  # the workers' reports: at the secret's URL below it
    config = FollowerConfig(
        engine=engine, model=model, target=url or target, max_lag=max_lag, pause_mode=pause_mode, path=path,
        client_id=client_id or f"{socket.gethostname()}-vllm-{engine_port}", timeout_s=timeout_s,
        update_timeout_s=update_timeout_s, notify=f"{staged_at.rstrip('/')}/{secret}", token=token,
        ca_cert=None if ca_cert is None else str(ca_cert), dequantize=dequantize,
    )
    if max_live:
        from weightsvc.integrations.vllm.adapters import AdapterFollower

        root = adapter_dir or Path(tempfile.gettempdir()) / "weightsvc-adapters"
        follower: Follower = AdapterFollower(config, metrics, max_live, root, say=say)
    else:
        follower = Follower(config, metrics, say=say)
    http.follower, http.metrics, http.secret = follower, metrics, secret  # type: ignore[attr-defined]
    threading.Thread(target=http.serve_forever, name="weightsvc-follow-http", daemon=True).start()
    say(json.dumps({"event": "listening", "address": bound, "engine": engine, "model": model}))

    def stop(_signum: int, _frame: Any) -> None:
        follower.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        follower.run()
    finally:
        http.shutdown()


class _Handler(BaseHTTPRequestHandler):
    server: Any  # the ThreadingHTTPServer, with the follower and its metrics

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._answer(200, self.server.metrics.render(), "text/plain; version=0.0.4")
        elif self.path == "/ready":
            ok, state = self.server.follower.ready()
            self._answer(200 if ok else 503, json.dumps(state).encode())
        elif self.path == "/healthz":
            self._answer(200, b'{"status": "ok"}')
        else:
            self._answer(404, b'{"error": "not found"}')

    def do_POST(self) -> None:
        from weightsvc.integrations.vllm.follower import ReportRefused

        route, _, secret = self.path.partition("/staged/")
        if route != "" and self.path != "/staged":
            self._answer(404, b'{"error": "not found"}')
            return
        if not hmac.compare_digest(secret.encode(), self.server.secret.encode()):
            self._refuse(403, "staging reports come from this follower's engine workers only, at the URL it gave them")
            return
        length = self.headers.get("Content-Length") or ""
        if not (length.isascii() and length.isdigit()):
            self._refuse(400, f"a staging report needs its Content-Length, not {length[:32]!r}")
            return
        if int(length) > MAX_REPORT_BYTES:
            self._refuse(413, f"a staging report of {length[:32]} bytes, more than the {MAX_REPORT_BYTES} it can need")
            return
        try:
            self.server.follower.staged(json.loads(self.rfile.read(int(length))))
        except (ValueError, RecursionError) as e:  # (ReportRefused is a ValueError)
            self._refuse(e.status if isinstance(e, ReportRefused) else 400, f"bad staging report: {e}")
            return
        self._answer(200, b"{}")

    def _refuse(self, status: int, message: str) -> None:
        self._answer(status, json.dumps({"error": message}).encode())
        self.close_connection = True

    def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # a scrape is no news
        pass
