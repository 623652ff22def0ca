"""`Follower`: the loop of `weightsvc follow`, a sidecar that keeps a `vllm serve` engine on the latest
version of a model: watch → stage → pause → swap → resume → ack, one version at a time, always the
latest one (the versions it is too late for are skipped).

Two paths into the engine, chosen at connect and said in the log:
- `transfer`: vLLM's RL API with weightsvc's backend (`--weight-transfer-config '{"backend":
  "weightsvc"}'`). The workers stage the version (pull, verify, check) while the engine generates;
  the pause covers only `start_weight_update` / `update_weights` / `finish_weight_update`.
- `collective_rpc`: an engine with weightsvc's worker extension only (`--worker-extension-cls`); each
  worker pulls and loads inside the pause (`weightsvc_load`).

While its update holds the engine paused, the engine's `weight_version` is `weightsvc-updating-N`
(no token is generated under it): a follower restarted after it was killed mid-update knows the
pause is its own and finishes the work; a pause under any other label is someone else's, and the
follower waits for it to end. A version is acked only once `/weight_info` says the engine serves it.

Nothing an engine or the weightsvc server answers ends the follower: every answer is checked
(`EngineApi`), and a bad one, like a failed call, is logged, counted and retried with backoff. A worker's
staging report is taken only for the version being staged, from a rank of the engine's world. The
server is asked every `SERVER_CHECK_S` whether it answers: the follower is not ready while it does not.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from weightsvc.client import InferenceClient
from weightsvc.errors import NotFound, WeightsvcError, subject
from weightsvc.integrations.vllm.engine_api import MAX_VERSION, EngineApi, EngineError, version_of

__all__ = ["PATHS", "PAUSE_MODES", "UPDATING", "Follower", "FollowerConfig", "Refused", "ReportRefused"]

PAUSE_MODES = ("keep", "wait", "abort")
PATHS = ("auto", "transfer", "collective_rpc")
UPDATING = "weightsvc-updating-"
MAX_BACKOFF_S = 30.0
SERVER_CHECK_S = 5.0  # how often the follower asks whether its weightsvc server answers
MAX_REPORTED_ERROR_CHARS = 2000  # of a worker's error, kept for the log


class ReportRefused(ValueError):
    """A staging report that is not taken: `status` is the HTTP answer to it (400: malformed, 409: not
    the version being staged)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Refused(EngineError):
    """A version that does not fit the engine: never loaded, never acked, not tried again."""


class UpdateMetrics(Protocol):
    """What a follower records of its updates (`weightsvc follow` gives it `weightsvc.metrics.FollowerMetrics`)."""

    def updated(self, path: str, update_s: float, pause_s: float) -> None: ...
    def failed(self, stage: str) -> None: ...
    def position(self, served: int | None, latest: int | None) -> None: ...


@dataclass
class FollowerConfig:
    engine: str
    model: str
    target: str
    client_id: str
    max_lag: int = 0
    pause_mode: str = "keep"
    path: str = "auto"
    timeout_s: float = 30.0  # every engine call but the swap and the staging
    update_timeout_s: float = 600.0  # the swap, and the staging of one version
    notify: str | None = None  # where the engine's workers say a version is staged (our /staged)
    token: str | None = None
    ca_cert: str | None = None
    dequantize: bool = False
    init_info: dict[str, Any] = field(default_factory=dict)  # more for the backend's init_info


class Follower:
    def __init__(self, config: FollowerConfig, metrics: UpdateMetrics,
                 say: Callable[[str], None] = print) -> None:
        self.config = config
        self.metrics = metrics
        self.say = say
        self.engine = EngineApi(config.engine, config.timeout_s)
        self.path: str | None = None  # None until connected
        self.served: int | None = None
        self.latest: int | None = None
        self.refused: set[int] = set()
        self._world = 1
        self._version: int | None = None  # the version of the update under way
        self._cut_short = False
        self._staging: int | None = None  # the version the workers are staging, whose reports are taken
        self._reports: dict[int, dict[str, Any]] = {}  # rank -> the worker's report of `_staging`
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._client: InferenceClient | None = None
        self.server_down: str | None = None  # why the weightsvc server does not answer (None: it does)
        self._said = threading.Lock()

    # ---- what the sidecar's HTTP server asks -------------------------------------------------------

    def staged(self, report: Any) -> None:
        """A worker's word that it staged a version (or failed to): `{"rank", "version", "pulled_bytes",
        "error"}`. ReportRefused for anything else, and for a version not being staged: nothing is kept."""
        if not isinstance(report, dict):
            raise ReportRefused("a staging report is a JSON object")
        fields: dict[str, Any] = {k: report.get(k) for k in ("rank", "version", "pulled_bytes", "error")}
        for key, kinds in (("rank", (int,)), ("version", (int,)), ("pulled_bytes", (int, type(None))),
                           ("error", (str, type(None)))):
            value = fields[key]
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ReportRefused(f"the staging report's {key!r} is {type(value).__name__}, not "
                                    f"{' or '.join('null' if k is type(None) else k.__name__ for k in kinds)}")
            if isinstance(value, int) and not 0 <= value <= MAX_VERSION:
                raise ReportRefused(f"the staging report's {key!r} is not between 0 and {MAX_VERSION}")
        rank, version, pulled, error = fields["rank"], fields["version"], fields["pulled_bytes"], fields["error"]
        with self._cond:
            if version != self._staging:
                raise ReportRefused(f"version {version} is not being staged (now: "
                                    f"{'none' if self._staging is None else self._staging})", 409)
            if rank >= self._world:
                raise ReportRefused(f"the staging report's rank {rank} is not one of the engine's {self._world} "
                                    "workers")
            self._reports[rank] = {"rank": rank, "version": version, "pulled_bytes": pulled,
                                   "error": None if error is None else error[:MAX_REPORTED_ERROR_CHARS]}
            self._cond.notify_all()

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Whether the engine serves the latest version within `max_lag` versions, and the weightsvc
        server answers (else the engine may be far behind without anybody knowing)."""
        state = {"path": self.path, "served": self.served, "latest": self.latest, "max_lag": self.config.max_lag}
        if self.path is None:
            return False, {**state, "reason": "not connected to the engine"}
        if self.server_down is not None:
            return False, {**state, "reason": f"the weightsvc server {self.config.target} does not answer: "
                                              f"{self.server_down}"}
        if self.latest is None:
            return True, state
        behind = self.latest - (self.served or 0)
        return behind <= self.config.max_lag, {**state, "behind": behind}

    # ---- the loop ---------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        if self._client is not None:
            self._client.close()  # ends the watch
        with self._cond:
            self._cond.notify_all()

    def run(self) -> None:
        """Follow until `stop`: every failure is logged, counted, and retried with backoff."""
        watcher = threading.Thread(target=self._watch, name="weightsvc-follow-watch", daemon=True)
        watcher.start()
        threading.Thread(target=self._check_server, name="weightsvc-follow-server", daemon=True).start()
        failures = 0
        while not self._stop.is_set():
            self._version = None
            try:
                if self.path is None:
                    self._connect()
                version = self._next()
                if version is None:
                    continue
                self._update(version)
                failures = 0
            except EngineError as e:
                if self._stop.is_set():
                    break  # stopped in the middle: nothing to report
                failures += 1
                self._failed(e.stage, str(e), refused=isinstance(e, Refused))
                if e.status is None:  # no answer: the engine may have restarted; connect again
                    self.path = None
                self._stop.wait(min(MAX_BACKOFF_S, 0.5 * 2 ** min(failures, 6)))
            except WeightsvcError as e:  # the weightsvc server: a version gone, a lost connection
                failures += 1
                self._failed("ack" if self._version is not None else "connect", str(e))
                self._stop.wait(min(MAX_BACKOFF_S, 0.5 * 2 ** min(failures, 6)))
            except Exception as e:  # a defect of ours: the sidecar stays up all the same
                failures += 1
                self._failed("internal", f"{type(e).__name__}: {e}")
                self._stop.wait(min(MAX_BACKOFF_S, 0.5 * 2 ** min(failures, 6)))

    def _server(self, timeout: bool = True) -> InferenceClient:
        """A client of the weightsvc server (each call bounded by `timeout_s`, but for a watch)."""
        c = self.config
        return InferenceClient(c.target, token=c.token, ca_cert=c.ca_cert, timeout=c.timeout_s if timeout else None)

    def _check_server(self) -> None:
        """Whether the weightsvc server answers, asked every SERVER_CHECK_S; a change is logged."""
        while not self._stop.is_set():
            try:
                with self._server() as client:
                    client.versions(self.config.model)
                down = None
            except NotFound:  # nothing committed yet: it answers
                down = None
            except WeightsvcError as e:
                down = str(e)
            was, self.server_down = self.server_down, down  # /ready says so before the change is logged
            if down is not None and was is None:
                self._failed("server", f"the weightsvc server {self.config.target} does not answer: {down}")
            elif down is None and was is not None:
                self._log("server_answers", target=self.config.target)
            self._stop.wait(SERVER_CHECK_S)

    def _watch(self) -> None:
        """The latest committed version, as the service announces them (reconnecting when it is lost)."""
        while not self._stop.is_set():
            try:
                with self._server(timeout=False) as client:
                    self._client = client
                    for info in client.watch(self.config.model):
                        with self._cond:
                            self.latest = max(info.version, self.latest or 0)
                            self._cond.notify_all()
                        self.metrics.position(self.served, self.latest)
            except Exception as e:  # (a WeightsvcError, or a defect of ours: the watch goes on)
                self._failed("watch", str(e) if isinstance(e, WeightsvcError) else f"{type(e).__name__}: {e}")
                self._stop.wait(1.0)

    def _next(self) -> int | None:
        """The version to load next (None when stopped, or nothing new within a second)."""
        def due() -> bool:
            return self.latest is not None and self.latest != self.served and self.latest not in self.refused

        with self._cond:
            self._cond.wait_for(lambda: self._stop.is_set() or due(), timeout=1.0)
            return self.latest if due() and not self._stop.is_set() else None

    def _connect(self) -> None:
        """Which path the engine offers, and the version it serves (acked again: idempotent)."""
        label = self.engine.weight_version()
        self._cut_short = label.startswith(UPDATING) and self.engine.is_paused(stage="connect")
        path = self.config.path
        self._world = 1
        if path in ("auto", "transfer"):
            try:
                self.engine.post("/init_weight_transfer_engine", {"init_info": self._init_info()}, stage="connect")
                path = "transfer"
                self._world = self.engine.world_size()
            except EngineError as e:
                if path == "transfer" or not (e.status == 404 or "not configured" in str(e)):
                    raise
                path = "collective_rpc"
        if path == "collective_rpc":
            try:
                self.engine.post("/collective_rpc", {"method": "weightsvc_alive"}, stage="connect")
            except EngineError as e:
                raise EngineError("connect", f"{e}; start the engine with --weight-transfer-config "
                                  "'{\"backend\": \"weightsvc\"}' or with --worker-extension-cls "
                                  "weightsvc.loaders.VllmWorkerExtension", e.status) from None
        self.path = path
        self.served = version_of(label)
        with self._server() as client:
            try:
                versions = [v.version for v in client.versions(self.config.model)]
            except NotFound:  # nothing committed yet: the watch says when
                versions = []
        with self._cond:  # the latest now, not the first of the watch's backlog: older ones are skipped
            self.latest = max([*versions, self.latest or 0]) if versions or self.latest else None
        self._log("connected", served=label)
        if self.served is not None and not self._cut_short:
            self._ack(self.served)

    def _init_info(self, **more: Any) -> dict[str, Any]:
        c = self.config
        info = {"target": c.target, "model": c.model, "ca_cert": c.ca_cert, "dequantize": c.dequantize,
                **c.init_info, **more}
        return {k: v for k, v in info.items() if v is not None}

    def _update(self, version: int) -> None:
        started = time.monotonic()
        self._version = version
        assert self.path is not None
        pulled = self._stage(version) if self.path == "transfer" else []
        staged = time.monotonic()
        self._log("staged", version=version, stage_s=round(staged - started, 3), pulled_bytes=pulled)
        label = self.engine.weight_version(stage="pause")
        if self.engine.is_paused() and not label.startswith(UPDATING):
            raise EngineError("pause", f"engine {self.config.engine} is paused by someone else (weight_version "
                              f"{label!r}); {subject(self.config.model, version)} waits for its resume", 409)
        self.engine.post(f"/pause?mode={self.config.pause_mode}", stage="pause",
                         timeout_s=self.config.update_timeout_s if self.config.pause_mode == "wait" else None)
        paused = time.monotonic()
        try:
            self.engine.label(f"{UPDATING}{version}", stage="pause")  # from here on, the pause is known as ours
            self._log("paused", version=version, mode=self.config.pause_mode)
            try:
                self._swap(version)
            except EngineError:  # nothing was loaded: the tokens keep the old label
                if not label.startswith(UPDATING):
                    self.engine.label(label, stage="swap")
                raise
            self.engine.post("/reset_prefix_cache", stage="resume")  # its KV was computed with the old weights
        finally:
            self.engine.post("/resume", stage="resume")
            resumed = time.monotonic()
        served = self.engine.weight_version(stage="verify")
        if served != str(version):
            raise EngineError("verify", f"engine {self.config.engine} serves {served!r} after loading model "
                              f"{self.config.model!r} version {version}; not acked")
        self.served = version
        self._cut_short = False
        self._ack(version)
        self.metrics.updated(self.path, time.monotonic() - started, resumed - paused)
        self._log("update", version=version, stage_s=round(staged - started, 3),
                  pause_s=round(resumed - paused, 3), update_s=round(time.monotonic() - started, 3))

    def _stage(self, version: int) -> list[int | None]:
        """Every worker pulls, checks and verifies the version while the engine generates; the bytes
        each pulled, by rank (unknown without `notify`)."""
        with self._cond:
            self._staging, self._reports = version, {}
        try:
            self.engine.post("/init_weight_transfer_engine",
                             {"init_info": self._init_info(stage=version, notify=self.config.notify)}, stage="stage")
            if self.config.notify is None:  # nobody to tell us: update_weights waits for the staged copy
                return []
            with self._cond:
                done = self._cond.wait_for(lambda: self._stop.is_set() or len(self._reports) >= self._world,
                                           timeout=self.config.update_timeout_s)
                reports = self._reports
        finally:
            with self._cond:
                self._staging, self._reports = None, {}
        if self._stop.is_set():
            raise EngineError("stage", f"stopped while {subject(self.config.model, version)} was staged")
        if not done:
            raise EngineError("stage", f"engine {self.config.engine}: {len(reports)} of {self._world} workers "
                              f"staged {subject(self.config.model, version)} within "
                              f"{self.config.update_timeout_s:g} s")
        errors = sorted(str(r["error"]) for r in reports.values() if r.get("error"))
        if errors:
            kind = Refused if any(e.startswith("Mismatch") for e in errors) else EngineError
            raise kind("stage", f"engine {self.config.engine}: {subject(self.config.model, version)} "
                       f"was not staged: {errors[0]}")
        return [reports[rank].get("pulled_bytes") for rank in sorted(reports)]

    def _swap(self, version: int) -> None:
        c = self.config
        try:
            if self.path == "transfer":
                if self._cut_short:  # a start a killed follower left open
                    with contextlib.suppress(EngineError):
                        self.engine.post("/finish_weight_update", stage="swap")
                self.engine.swap(version, c.update_timeout_s)
            else:
                self.engine.post("/collective_rpc", {"method": "weightsvc_load", "timeout": c.update_timeout_s,
                                                     "args": [c.target, c.model, str(version), str(c.dequantize)]},
                                 stage="swap", timeout_s=c.update_timeout_s)
                self.engine.label(str(version), stage="swap")
        except EngineError as e:
            if "Mismatch" in str(e):
                raise Refused(e.stage, f"{subject(c.model, version)} does not fit: {e}", e.status) from None
            raise

    def _ack(self, version: int) -> None:
        with self._server() as client:
            client.ack(self.config.model, version, self.config.client_id)
        self.metrics.position(self.served, self.latest)

    def _failed(self, stage: str, error: str, refused: bool = False) -> None:
        self.metrics.failed(stage)
        if refused and self._version is not None:
            self.refused.add(self._version)
        self._log("refused" if refused else "failed", stage=stage, version=self._version, error=error)

    def _log(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "engine": self.config.engine, "model": self.config.model,
                           "path": self.path, **fields})
        with self._said:  # three threads log: one line at a time (print writes the newline apart)
            self.say(line)
