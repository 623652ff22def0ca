"""The `vllm.general_plugins` entry point of weightsvc (pyproject.toml): vLLM calls `register` in each
of its processes, which makes `--weight-transfer-config '{"backend": "weightsvc"}'` select
`WeightsvcTransferEngine`. The engine's module is imported only where vLLM builds one."""

from __future__ import annotations

import contextlib

BACKEND = "weightsvc"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already: vLLM may load its plugins more than once
        WeightTransferEngineFactory.register_engine(BACKEND, "weightsvc.integrations.vllm.transfer",
                                                    "WeightsvcTransferEngine")
