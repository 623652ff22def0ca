"""`AdapterFollower`: `weightsvc follow --max-live N` for an adapter model. Each version of a LoRA
adapter model is loaded into a `vllm serve` engine (`--enable-lora`, with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`) as a revision of its own, `MODEL@vN`, beside the ones before
it: nothing pauses, and a request keeps the revision it named to its end. The newest N revisions stay
loaded; an older one is unloaded (no new request can name it), and once no request runs or waits on
it (vLLM's `vllm:lora_requests_info`) its directory is deleted and, with the dev routes, the engine's
cached copy is dropped. Several followers, one per adapter model, share one base engine.

vLLM loads an adapter from a directory only (`LoRARequest.lora_path`; it reloads from there when
its cache evicted the adapter), so each revision gets one, `ADAPTER_DIR/MODEL@vN`, written from the
pulled served copy (checksums verified) and the PEFT config of its manifest. The engine must read the
same path (the same host, or a shared volume in a pod).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from weightsvc.client import InferenceClient
from weightsvc.errors import NotFound, subject
from weightsvc.integrations.vllm.engine_api import EngineError
from weightsvc.integrations.vllm.follower import Follower, FollowerConfig, Refused, UpdateMetrics
from weightsvc.integrations.vllm.revisions import write_revision
from weightsvc.protocol.adapter import parse_revision, revision
from weightsvc.protocol.manifest import Manifest

__all__ = ["AdapterFollower"]

_LORA_INFO = re.compile(r"^vllm:lora_requests_info\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class AdapterMetrics(UpdateMetrics, Protocol):
    def live(self, revisions: int) -> None: ...


class AdapterFollower(Follower):
    def __init__(self, config: FollowerConfig, metrics: AdapterMetrics, max_live: int, adapter_dir: Path,
                 say: Callable[[str], None] = print) -> None:
        super().__init__(config, metrics, say)
        if max_live < 1:
            raise ValueError(f"max_live {max_live} must be at least 1")
        self.adapter_metrics = metrics
        self.max_live = max_live
        self.root = adapter_dir
        self.live: dict[int, int | None] = {}  # version -> the engine's adapter id (None: unknown)
        self.retiring: dict[int, int | None] = {}  # unloaded; deleted once no request runs on them

    def ready(self) -> tuple[bool, dict[str, Any]]:
        ok, state = super().ready()
        names = [revision(self.config.model, v) for v in sorted(self.live)]
        return ok, {**state, "revisions": names, "newest": names[-1] if names else None}

    # ---- the steps --------------------------------------------------------------------------------

    def _connect(self) -> None:
        """The revisions of this model the engine holds (a follower that restarts adopts them, and
        trims the window), and the directories no revision uses any more."""
        self.root.mkdir(parents=True, exist_ok=True)
        loaded = self._loaded()
        self.path = "lora"
        self.live = {v: self.live.get(v) for v in sorted(loaded)}
        self.served = max(self.live, default=None)
        with self._server() as client:
            try:
                versions = [v.version for v in client.versions(self.config.model)]
            except NotFound:
                versions = []
        with self._cond:
            self.latest = max([*versions, self.latest or 0]) if versions or self.latest else None
        self._log("connected", revisions=[revision(self.config.model, v) for v in self.live])
        self._trim()
        for d in self.root.glob(f"{self.config.model}@v*"):  # left by a follower that was killed
            parsed = parse_revision(d.name)
            if parsed and parsed[0] == self.config.model and parsed[1] not in self.live | self.retiring:
                shutil.rmtree(d, ignore_errors=True)
        if self.served is not None:
            self._ack(self.served)

    def _next(self) -> int | None:
        if self.retiring and self.path is not None:
            self._reap()
        return super()._next()

    def _update(self, version: int) -> None:
        started = time.monotonic()
        self._version = version
        name = revision(self.config.model, version)
        with InferenceClient(self.config.target, token=self.config.token, ca_cert=self.config.ca_cert) as client:
            manifest = client.manifest(self.config.model, version)
            self._check(manifest)
            where = write_revision(client, manifest, self.root)
        pulled = time.monotonic()
        before = self._engine_ids()
        try:
            self.engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(where)}, stage="load")
        except EngineError as e:
            if e.status is not None and e.status <= 500:  # it answered: this adapter does not fit
                shutil.rmtree(where, ignore_errors=True)
                hint = ("; start it with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" if e.status == 404
                        else "")
                raise Refused("load", f"{subject(self.config.model, version)}: the engine refused "
                              f"adapter {name!r}: {e}{hint}", e.status) from None
            raise
        after = self._engine_ids()
        new = after - before if before is not None and after is not None else set()
        self.live[version] = new.pop() if len(new) == 1 else None
        self.served = max(self.live)
        self._ack(self.served)
        self.metrics.updated("lora", time.monotonic() - started, 0.0)
        self._log("loaded", version=version, revision=name, pull_s=round(pulled - started, 3),
                  update_s=round(time.monotonic() - started, 3),
                  revisions=[revision(self.config.model, v) for v in sorted(self.live)])
        self._trim()

    def _check(self, manifest: Manifest) -> None:
        """Refuse (by name) a version that is no adapter, or whose base is not the engine's."""
        where = subject(self.config.model, manifest.version)
        a = manifest.adapter
        if a is None:
            raise Refused("load", f"{where} is not an adapter version (its manifest names no base); follow it "
                          "without --max-live")
        bases = {n for card in self._models() if not card.get("parent")
                 for n in (card["id"], card.get("root") or "", Path(card.get("root") or "").name) if n}
        if a.base_model not in bases:
            raise Refused("load", f"{where}: its base is {a.base_model!r}; engine {self.config.engine} serves "
                          f"{sorted(bases)}")
        if a.base_version:
            served = self.engine.weight_version(stage="load")
            if served.isdigit() and int(served) != a.base_version:
                raise Refused("load", f"{where}: adapter of base {a.base_model!r} version {a.base_version}; "
                              f"engine {self.config.engine} serves version {served}")

    def _trim(self) -> None:
        """Unload the revisions beyond the newest `max_live` (requests on them run on)."""
        for version in sorted(self.live)[: max(0, len(self.live) - self.max_live)]:
            name = revision(self.config.model, version)
            try:
                self.engine.post("/v1/unload_lora_adapter", {"lora_name": name}, stage="unload")
            except EngineError as e:
                if e.status != 404:  # (404: unloaded already)
                    raise
            self.retiring[version] = self.live.pop(version)
            self._log("unloaded", version=version, revision=name)
        self.adapter_metrics.live(len(self.live))
        self._reap()

    def _reap(self) -> None:
        """Delete the unloaded revisions no request runs or waits on: their directory, and the
        engine's cached copy (dev routes only; vLLM's cache evicts it otherwise). An engine without
        `vllm:lora_requests_info` (`--disable-log-stats`) says nothing of its requests: the newest
        `max_live` unloaded revisions are kept for those in flight, older ones deleted."""
        busy = self._busy()
        if busy is None:
            done = sorted(self.retiring)[: max(0, len(self.retiring) - self.max_live)]
        else:
            done = [v for v in self.retiring if revision(self.config.model, v) not in busy]
        for version in done:
            adapter_id = self.retiring.pop(version)
            if adapter_id is not None:
                with contextlib.suppress(EngineError):
                    self.engine.post("/collective_rpc", {"method": "remove_lora", "args": [adapter_id]},
                                     stage="unload")
            shutil.rmtree(self.root / revision(self.config.model, version), ignore_errors=True)
            self._log("removed", version=version, revision=revision(self.config.model, version))

    # ---- what the engine says ---------------------------------------------------------------------

    def _models(self) -> list[dict[str, Any]]:
        return list(self.engine.call("GET", "/v1/models", stage="connect")["data"])

    def _loaded(self) -> set[int]:
        """The versions of this model the engine serves as revisions."""
        out = set()
        for card in self._models():
            parsed = parse_revision(str(card["id"]))
            if parsed is not None and parsed[0] == self.config.model:
                out.add(parsed[1])
        return out

    def _engine_ids(self) -> set[int] | None:
        """The ids of the adapters the engine's workers hold (None without the dev routes)."""
        try:
            answer = self.engine.post("/collective_rpc", {"method": "list_loras"}, stage="load")
        except EngineError as e:
            if e.status is None:
                raise
            return None
        return {int(i) for i in answer["results"][0]}

    def _busy(self) -> set[str] | None:
        """The adapters requests run or wait on, from the engine's latest `vllm:lora_requests_info`
        (None when it has none: deleting nothing is the safe answer)."""
        try:
            text = self.engine.call("GET", "/metrics", stage="unload")
        except EngineError:
            return None
        if not isinstance(text, str) or "vllm:lora_requests_info" not in text:
            return None
        latest: tuple[float, set[str]] | None = None
        for m in _LORA_INFO.finditer(text):
            labels = dict(_LABEL.findall(m["labels"]))
            names = {n for key in ("running_lora_adapters", "waiting_lora_adapters")
                     for n in labels.get(key, "").split(",") if n}
            if latest is None or float(m["value"]) >= latest[0]:
                latest = (float(m["value"]), names)
        return set() if latest is None else latest[1]  # (no series yet: no request has run)
