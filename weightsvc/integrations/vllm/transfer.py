"""`WeightsvcTransferEngine`: weightsvc as a weight-transfer backend of vLLM's RL API, selected with
`vllm serve MODEL --weight-transfer-config '{"backend": "weightsvc"}'` (registered by `plugin`), or
`'{"backend": "weightsvc-nixl"}'` for `WeightsvcNixlTransferEngine`, whose workers READ their slices
over NIXL from a `serve --nixl` server into their staging (over TCP, said in one line, when NIXL
cannot reach it). The init info's `"transport"` ("tcp" or "nixl") overrides the backend's. This
module imports vLLM: vLLM's factory imports it in each worker.

The four phases as the backend sees them, in each worker:
- `init_weight_transfer_engine({"target", "model", ...})`: where to pull from (`WeightsvcInitInfo`).
  With `"stage": N` the worker starts pulling version N into its staging memory in a thread of its
  own and returns at once: the bytes move while the engine generates. With `"notify": URL` it POSTs
  `{"rank", "version", "pulled_bytes", "error"}` there once staged (or failed).
- `start_weight_update`: nothing is touched yet.
- `update_weights({"version": N})`: the staged copy of N (waited for if still moving; pulled now if
  never staged), checked and verified, is swapped in through vLLM's layerwise reload. A version that
  does not fit, or a pull that fails, raises before any layer is touched: the engine keeps its weights.
- `finish_weight_update`: nothing left to do (the server sets `weight_version` itself).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsvc.client import InferenceClient
from weightsvc.integrations.vllm.worker import pull_for_rank, reload_in_place, tp_rank

__all__ = ["NOTIFY_TIMEOUT_S", "TRANSPORTS", "WeightsvcInitInfo", "WeightsvcNixlTransferEngine",
           "WeightsvcTransferEngine", "WeightsvcUpdateInfo"]

log = logging.getLogger(__name__)
NOTIFY_TIMEOUT_S = 10.0
TRANSPORTS = ("tcp", "nixl")

Staged = tuple[int, dict[str, torch.Tensor], int]  # (version, weights ready for load_weights, bytes pulled)


@dataclass
class WeightsvcInitInfo(WeightTransferInitInfo):
    """Where the workers pull from. The bearer token comes from the engine's environment
    (`WEIGHTSVC_TOKEN`), never over the engine's HTTP API; `ca_cert` is a path on the engine's machine."""

    target: str
    model: str = "default"
    ca_cert: str | None = None
    dequantize: bool = False  # load an fp8 version as values into an engine in a higher precision
    stage: int | None = None  # a version to start pulling now, before the pause
    notify: str | None = None  # a URL told when the staged version is in (or failed)
    transport: str | None = None  # "tcp" or "nixl"; None: the backend's


@dataclass
class WeightsvcUpdateInfo(WeightTransferUpdateInfo):
    version: int


class WeightsvcTransferEngine(WeightTransferEngine[WeightsvcInitInfo, WeightsvcUpdateInfo]):
    """Each worker pulls its tensor-parallel slice of a weightsvc version, verifies it, and swaps it in."""

    init_info_cls = WeightsvcInitInfo
    update_info_cls = WeightsvcUpdateInfo
    supports_draft_weight_update = False
    transport = "tcp"  # how the workers pull unless the init info says

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source: WeightsvcInitInfo | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsvc-stage")  # one pull at a time
        self._lock = threading.Lock()
        self._staging: dict[int, Future[Staged]] = {}  # the latest version asked for, at most one

    def init_transfer_engine(self, init_info: WeightsvcInitInfo) -> None:
        if init_info.transport is not None and init_info.transport not in TRANSPORTS:
            raise ValueError(f"weightsvc: transport {init_info.transport!r} is none of {', '.join(TRANSPORTS)}")
        self.source = init_info
        if init_info.stage is not None:
            self._stage(init_info, int(init_info.stage))

    def start_weight_update(self) -> None:
        self._source()

    def receive_weights(self, update_info: WeightsvcUpdateInfo) -> None:
        version = int(update_info.version)
        with self._lock:
            staged = self._staging.pop(version, None)
        if staged is None:  # never staged: pulled now, inside the pause
            staged = self._pool.submit(self._pull, self._source(), version)
        _, weights, _ = staged.result()  # a failed or torn pull raises here: nothing was touched
        reload_in_place(self.model, self.model_config, weights)
        log.info("weightsvc: model %r version %d loaded", self._source().model, version)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # (vLLM's own synchronize fails on the CPU, which has none)
            torch.accelerator.synchronize()

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        with self._lock:
            self._staging.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _source(self) -> WeightsvcInitInfo:
        if self.source is None:
            raise RuntimeError("the weightsvc backend has no source yet: call init_weight_transfer_engine with "
                               '{"target": HOST:PORT, "model": MODEL} first')
        return self.source

    def _stage(self, source: WeightsvcInitInfo, version: int) -> None:
        with self._lock:
            if version in self._staging:  # staged or on its way: said again once it is in
                future = self._staging[version]
            else:  # only the latest version matters: older staged copies are dropped
                self._staging.clear()
                future = self._staging[version] = self._pool.submit(self._pull, source, version)
        if source.notify:
            future.add_done_callback(lambda f: self._notify(source, version, f))

    def _pull(self, source: WeightsvcInitInfo, version: int) -> Staged:
        rank, size = tp_rank()
        with InferenceClient(source.target, ca_cert=source.ca_cert) as client:
            manifest, weights, pulled = pull_for_rank(client, source.model, version, self.model_config, rank,
                                                      size, source.dequantize, source.transport or self.transport)
        return manifest.version, weights, pulled

    def _notify(self, source: WeightsvcInitInfo, version: int, future: Future[Staged]) -> None:
        error = future.exception()
        body = {"rank": tp_rank()[0], "model": source.model, "version": version,
                "pulled_bytes": None if error is not None else future.result()[2],
                "error": None if error is None else f"{type(error).__name__}: {error}"}
        if error is not None:
            log.warning("weightsvc: staging model %r version %d failed: %s", source.model, version, body["error"])
        request = urllib.request.Request(str(source.notify), data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=NOTIFY_TIMEOUT_S):
                pass
        except OSError as e:  # the follower is gone: it stages again when it comes back
            log.warning("weightsvc: cannot tell %s that version %d is staged: %s", source.notify, version, e)


class WeightsvcNixlTransferEngine(WeightsvcTransferEngine):
    """The backend `weightsvc-nixl`: each worker READs its slice over NIXL into its staging."""

    transport = "nixl"
