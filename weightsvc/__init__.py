"""weightsvc: weight broadcast for RL fine-tuning with unbiased (Fair Cast) low-precision export."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsvc.client import InferenceClient, LearnerClient, VersionInfo
    from weightsvc.settings import Settings

__version__ = "0.1.0"
__all__ = ["InferenceClient", "LearnerClient", "Settings", "VersionInfo", "__version__"]

# Loaded on first use: `import weightsvc` (every command does) stays cheap, and a command that
# needs neither the clients nor the settings does not pay for grpc or pydantic-settings.
_LAZY = {
    "InferenceClient": "weightsvc.client",
    "LearnerClient": "weightsvc.client",
    "VersionInfo": "weightsvc.client",
    "Settings": "weightsvc.settings",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weightsvc' has no attribute {name!r}")
