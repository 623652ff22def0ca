"""weightsvc: weight broadcast for RL fine-tuning with unbiased (Fair Cast) low-precision export."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsvc.settings import Settings

if TYPE_CHECKING:
    from weightsvc.client import InferenceClient, LearnerClient, VersionInfo

__version__ = "0.1.0"
__all__ = ["InferenceClient", "LearnerClient", "Settings", "VersionInfo", "__version__"]


def __getattr__(name: str) -> Any:
    # The clients import torch; the server does not need it, so load them on first use.
    if name in ("InferenceClient", "LearnerClient", "VersionInfo"):
        from weightsvc import client

        return getattr(client, name)
    raise AttributeError(f"module 'weightsvc' has no attribute {name!r}")
