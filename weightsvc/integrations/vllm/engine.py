"""The driver side of vLLM: `update_vllm` loads a version into every worker of an `LLM` through
`collective_rpc`. vLLM is never imported here: the `LLM` is duck-typed."""

from __future__ import annotations

import queue
import threading
from typing import Any

from weightsvc.client import InferenceClient
from weightsvc.errors import subject
from weightsvc.integrations._common import update
from weightsvc.integrations.vllm.checkpoint import check_engine_fits
from weightsvc.protocol.manifest import Manifest

__all__ = ["ALIVE_TIMEOUT_S", "update_vllm"]

ALIVE_TIMEOUT_S = 10.0  # for the workers of a live engine to answer after a failed update


def _alive(llm: Any) -> bool:
    """Whether every worker of a vLLM engine still answers (after a failed update: died, or refused?).
    Asked from a thread of its own: a call into an engine whose process died can wait forever."""
    answer: queue.SimpleQueue[bool] = queue.SimpleQueue()

    def ask() -> None:
        try:
            llm.collective_rpc("weightsvc_alive")
            answer.put(True)
        except Exception:
            answer.put(False)

    threading.Thread(target=ask, name="weightsvc-vllm-alive", daemon=True).start()
    try:
        return answer.get(timeout=ALIVE_TIMEOUT_S)
    except queue.Empty:
        return False


def update_vllm(
    llm: Any,
    target: str,
    model: str = "default",
    version: int | str = "latest",
    *,
    client_id: str | None = None,
    dequantize: bool = False,
) -> int:
    """Load a version into every worker of a vLLM `LLM` and ack it; returns the version.

    The version is resolved here, once, so that all tensor-parallel workers load the same one even
    if a new version commits meanwhile. `dequantize` loads an fp8 version as values into an engine
    that runs a higher precision. The prefix cache is reset afterwards (its KV entries were computed
    with the old weights). A version that does not fit raises `Mismatch` before any worker writes
    a weight; an engine that fails or dies during the update raises, and nothing is acked."""

    def load(_client: InferenceClient, m: Manifest) -> None:
        config = getattr(llm, "model_config", None)
        if config is not None:  # refused here, before any worker starts; each worker checks again
            check_engine_fits(m, config, dequantize=dequantize)
        try:
            llm.collective_rpc("weightsvc_load", args=(target, model, m.version, dequantize))
        except Exception as e:
            if _alive(llm):  # a load that failed in a live engine: its own error says why
                raise
            raise RuntimeError(f"{subject(model, m.version)}: the vLLM engine died during the update "
                               f"({type(e).__name__}: {e}); it was not acked") from e
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()

    return update(target, model, version, client_id, load)
