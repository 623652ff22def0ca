"""`EngineApi`: the routes of vLLM's HTTP server (`vllm serve`, with `VLLM_SERVER_DEV_MODE=1`) that a
follower drives, each call bounded by a timeout; every failure is an `EngineError` naming the engine,
the route and the stage of the update it belongs to."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["EngineApi", "EngineError"]


class EngineError(RuntimeError):
    """A call to the engine that failed: `stage` is the step of the update it belongs to, `status` the
    HTTP status (None: no answer)."""

    def __init__(self, stage: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.status = status


class EngineApi:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, method: str, route: str, body: dict[str, Any] | None = None, *, stage: str,
             timeout_s: float | None = None) -> Any:
        """The engine's JSON answer to `method route` (None when it has no body)."""
        timeout = timeout_s or self.timeout_s
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{route}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        where = f"engine {self.url}: {method} {route.partition('?')[0]}"
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise EngineError(stage, f"{where} answered {e.code}: {_detail(e.read())}", e.code) from None
        except TimeoutError:
            raise EngineError(stage, f"{where}: no answer within {timeout:g} s") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise EngineError(stage, f"{where}: unreachable ({reason})") from None
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:  # (vLLM answers a LoRA load or unload with a plain sentence)
            return raw.decode(errors="replace")

    def post(self, route: str, body: dict[str, Any] | None = None, *, stage: str,
             timeout_s: float | None = None) -> Any:
        return self.call("POST", route, {} if body is None else body, stage=stage, timeout_s=timeout_s)

    def weight_version(self, stage: str = "connect") -> str:
        return str(self.call("GET", "/weight_info", stage=stage)["weight_version"])

    def is_paused(self, stage: str = "pause") -> bool:
        return bool(self.call("GET", "/is_paused", stage=stage)["is_paused"])

    def world_size(self) -> int:
        return int(self.call("GET", "/get_world_size?include_dp=false", stage="connect")["world_size"])

    def label(self, version: str, stage: str) -> None:
        """Set the engine's `weight_version`, the label of the tokens it generates from now on."""
        self.post("/update_weight_version", {"new_version": version}, stage=stage)


def _detail(raw: bytes) -> str:
    """The message of an error answer: vLLM's `{"error": {"message"}}`, FastAPI's `{"detail"}`, or the text."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in body:
            return str(body["detail"])
    return json.dumps(body)[:500]
