"""`EngineApi`: the routes of vLLM's HTTP server (`vllm serve`, with `VLLM_SERVER_DEV_MODE=1`) that a
follower drives. Each call is bounded as a whole by its timeout (an engine that trickles its answer a
byte at a time is cut off), each answer by its size, and the answers a follower acts on are checked
for their shape; every failure is an `EngineError` naming the engine, the route and the stage of the
update it belongs to."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.parse
from typing import Any

from weightsvc._small_http import cut_after

__all__ = ["MAX_ANSWER_BYTES", "EngineApi", "EngineError", "version_of"]

MAX_ANSWER_BYTES = 16 << 20  # the largest answer read (vLLM's /metrics, with many adapters loaded)
MAX_LABEL_CHARS = 256  # a weight_version label longer than this is no label anybody set on purpose
_VERSION = re.compile(r"[0-9]{1,19}", re.ASCII)
MAX_VERSION = (1 << 63) - 1  # a version is a signed 64-bit step
MAX_WORLD_SIZE = 1 << 16


class EngineError(RuntimeError):
    """A call to the engine that failed: `stage` is the step of the update it belongs to, `status` the
    HTTP status (None: no answer)."""

    def __init__(self, stage: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.status = status


def version_of(label: str) -> int | None:
    """The weightsvc version an engine's `weight_version` label names, None for a label of anything
    else (a checkpoint's name, `weightsvc-updating-N`)."""
    if _VERSION.fullmatch(label) and int(label) <= MAX_VERSION:
        return int(label)
    return None


class EngineApi:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        parts = urllib.parse.urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host, self._port, self._prefix = parts.hostname or "", parts.port, parts.path

    def call(self, method: str, route: str, body: dict[str, Any] | None = None, *, stage: str,
             timeout_s: float | None = None) -> Any:
        """The engine's JSON answer to `method route` (None when it has no body), whole within the timeout."""
        timeout = timeout_s or self.timeout_s
        where = f"engine {self.url}: {method} {route.partition('?')[0]}"
        data = None if body is None else json.dumps(body).encode()
        started = time.monotonic()
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = kind(self._host, self._port, timeout=timeout)
        response: http.client.HTTPResponse | None = None
        try:
            conn.connect()
            assert conn.sock is not None
            with cut_after(conn.sock, timeout - (time.monotonic() - started)) as cut:
                try:
                    conn.request(method, f"{self._prefix}{route}", body=data,
                                 headers={"Content-Type": "application/json"})
                    response = conn.getresponse()
                    raw = response.read(MAX_ANSWER_BYTES + 1)
                except (OSError, http.client.HTTPException):
                    if not cut.fired:
                        raise
            if cut.fired:
                raise TimeoutError
        except TimeoutError:
            raise EngineError(stage, f"{where}: no answer within {timeout:g} s") from None
        except OSError as e:
            raise EngineError(stage, f"{where}: unreachable ({e or type(e).__name__})") from None
        except http.client.HTTPException as e:
            raise EngineError(stage, f"{where}: no valid HTTP answer ({e!r})") from None
        finally:
            conn.close()
        assert response is not None
        if len(raw) > MAX_ANSWER_BYTES:
            raise EngineError(stage, f"{where} answered more than {MAX_ANSWER_BYTES} bytes", response.status)
        if response.status >= 400:
            raise EngineError(stage, f"{where} answered {response.status}: {_detail(raw)}", response.status)
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # (vLLM answers a LoRA load or unload with a plain sentence)
            return raw.decode(errors="replace")

    def post(self, route: str, body: dict[str, Any] | None = None, *, stage: str,
             timeout_s: float | None = None) -> Any:
        return self.call("POST", route, {} if body is None else body, stage=stage, timeout_s=timeout_s)

    def field(self, route: str, key: str, kinds: tuple[type, ...], *, stage: str) -> Any:
        """`key` of the engine's JSON object answer to `GET route`, of one of `kinds`; any other answer
        is an EngineError that quotes it."""
        answer = self.call("GET", route, stage=stage)
        value = answer.get(key, _MISSING) if isinstance(answer, dict) else _MISSING
        if value is _MISSING or isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise EngineError(stage, f"engine {self.url}: GET {route.partition('?')[0]} answered {_excerpt(answer)}: "
                              f"not a JSON object with {key!r} of {names}", 200)
        return value

    def weight_version(self, stage: str = "connect") -> str:
        """The label of the weights the engine serves (`"None"` before anybody set one)."""
        label = str(self.field("/weight_info", "weight_version", (str, int, type(None)), stage=stage))
        if len(label) > MAX_LABEL_CHARS or (label.isdigit() and version_of(label) is None):
            raise EngineError(stage, f"engine {self.url}: GET /weight_info answered weight_version "
                              f"{_excerpt(label)}: neither a version (ASCII digits, at most {MAX_VERSION}) nor "
                              f"a label of at most {MAX_LABEL_CHARS} characters", 200)
        return label

    def is_paused(self, stage: str = "pause") -> bool:
        return bool(self.field("/is_paused", "is_paused", (bool,), stage=stage))

    def world_size(self) -> int:
        size = self.field("/get_world_size?include_dp=false", "world_size", (int,), stage="connect")
        if not 1 <= size <= MAX_WORLD_SIZE:
            raise EngineError("connect", f"engine {self.url}: GET /get_world_size answered world_size {size}: "
                              f"not between 1 and {MAX_WORLD_SIZE}", 200)
        return int(size)

    def swap(self, version: int, timeout_s: float) -> None:
        """Swap weightsvc version `version` into a paused engine through vLLM's RL API and its weightsvc
        backend (staged beforehand, or pulled now), and label the tokens it generates from now on with it."""
        self.post("/start_weight_update", stage="swap")
        self.post("/update_weights", {"update_info": {"version": version}}, stage="swap", timeout_s=timeout_s)
        self.post("/finish_weight_update", {"weight_version": str(version)}, stage="swap")

    def label(self, version: str, stage: str) -> None:
        """Set the engine's `weight_version`, the label of the tokens it generates from now on."""
        self.post("/update_weight_version", {"new_version": version}, stage=stage)


_MISSING = object()
EXCERPT_CHARS = 64


def _excerpt(value: Any) -> str:
    """An answer as an error quotes it: the start of it, never all of a long one."""
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(text) if len(text) <= EXCERPT_CHARS else f"{text[:EXCERPT_CHARS]!r}... ({len(text)} characters)"


def _detail(raw: bytes) -> str:
    """The message of an error answer: vLLM's `{"error": {"message"}}`, FastAPI's `{"detail"}`, or the text."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw.decode(errors="replace")[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:500]
        if "detail" in body:
            return str(body["detail"])[:500]
    return json.dumps(body)[:500]
