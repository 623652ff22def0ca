"""weightsvc: weight broadcast for RL fine-tuning with unbiased (Fair Cast) low-precision export."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsvc.client import InferenceClient, LearnerClient, VersionInfo
    from weightsvc.settings import Settings

__version__ = "0.1.0"
__all__ = ["InferenceClient", "LearnerClient", "Settings", "VersionInfo", "__version__"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: the settings import the export kernels (numba), which a client does not
    # need; the clients import grpc, which `weightsvc export` does not.
    if name == "Settings":
        from weightsvc.settings import Settings

        return Settings
    if name in ("InferenceClient", "LearnerClient", "VersionInfo"):
        from weightsvc import client

        return getattr(client, name)
    raise AttributeError(f"module 'weightsvc' has no attribute {name!r}")
