"""The `vllm.general_plugins` entry point of weightsvc (pyproject.toml): vLLM calls `register` in each
of its processes, which makes `--weight-transfer-config '{"backend": "weightsvc"}'` select
`WeightsvcTransferEngine`, and `'{"backend": "weightsvc-nixl"}'` the same engine reading over NIXL
(vLLM's config takes a backend's name and nothing else). The engine's module is imported only where
vLLM builds one."""

from __future__ import annotations

import contextlib

BACKEND = "weightsvc"
NIXL_BACKEND = "weightsvc-nixl"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, engine in ((BACKEND, "WeightsvcTransferEngine"), (NIXL_BACKEND, "WeightsvcNixlTransferEngine")):
        with contextlib.suppress(ValueError):  # registered already: vLLM may load its plugins more than once
            WeightTransferEngineFactory.register_engine(name, "weightsvc.integrations.vllm.transfer", engine)
