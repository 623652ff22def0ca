"""weightsvc: weight broadcast for RL fine-tuning with unbiased (Fair Cast) low-precision export."""

from weightsvc._settings import Settings
from weightsvc.client import InferenceClient, LearnerClient, VersionInfo

__version__ = "0.1.0"
__all__ = ["InferenceClient", "LearnerClient", "Settings", "VersionInfo", "__version__"]
