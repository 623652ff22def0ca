"""What every engine's update shares: the refusal of a version that does not fit, and the
resolve-load-ack sequence."""

from __future__ import annotations

from collections.abc import Callable

from weightsvc.client import InferenceClient
from weightsvc.protocol.manifest import Manifest


class Mismatch(ValueError):
    """A version that does not fit the engine it was to be loaded into; nothing was written."""


def update(target: str, model: str, version: int | str, client_id: str | None,
           load: Callable[[InferenceClient, Manifest], object]) -> int:
    """Resolve `version` once, `load(client, manifest)` it, and ack it once loaded; returns its number.
    Resolving once is what makes every worker of a tensor-parallel engine load the same version."""
    with InferenceClient(target) as client:
        manifest = client.manifest(model, version)
        load(client, manifest)
        client.ack(model, manifest.version, client_id)
    return manifest.version
