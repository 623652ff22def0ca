"""A vLLM worker extension whose worker dies in the middle of an update, as one the OOM killer takes."""

import os
from typing import Any

from weightsvc.loaders import VllmWorkerExtension


class DyingWorkerExtension(VllmWorkerExtension):
    def weightsvc_load(self, *args: Any) -> Any:
        os._exit(1)
