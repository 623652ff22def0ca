"""SGLang (`sglang.Engine`), driven through its own update API; weightsvc never imports SGLang.

    update_sglang(engine, "weightsvc:50051", "policy")
"""

from __future__ import annotations

from typing import Any

from weightsvc.client import InferenceClient
from weightsvc.errors import subject
from weightsvc.integrations._common import update
from weightsvc.protocol.manifest import Manifest

__all__ = ["update_sglang"]


def update_sglang(
    engine: Any,
    target: str,
    model: str = "default",
    version: int | str = "latest",
    *,
    client_id: str | None = None,
    flush_cache: bool = True,
) -> int:
    """Pull a version into a running `sglang.Engine` with `update_weights_from_tensor` and ack it.

    Written against SGLang 0.5.23 (`update_weights_from_tensor(named_tensors, load_format=None,
    flush_cache=True)` -> `(success, message)`), inside the `begin_weight_update()` /
    `end_weight_update()` session that 0.5.21 and later require. Its model loaders take checkpoint
    names and shapes, as the learner pushed them; tied aliases come under both names (its models
    skip the head when the config ties it). The prefix cache is flushed: KV entries computed with
    the old weights are stale. An update the engine reports as failed raises, and is not acked."""

    def load(client: InferenceClient, m: Manifest) -> None:
        weights = client.pull(model, m.version)
        session = hasattr(engine, "begin_weight_update")  # SGLang 0.5.21 and later update in a session
        if session:
            engine.begin_weight_update()
        try:
            result = engine.update_weights_from_tensor(named_tensors=list(weights.items()), flush_cache=flush_cache)
        finally:
            if session:
                engine.end_weight_update()
        if isinstance(result, tuple) and result and result[0] is False:
            why = result[1] if len(result) > 1 else "no reason given"
            raise RuntimeError(f"{subject(model, m.version)}: SGLang refused the update: {why}")

    return update(target, model, version, client_id, load)
