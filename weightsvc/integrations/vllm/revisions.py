"""Revisions of an adapter model in vLLM: the directory vLLM loads each from (`write_revision`: the
pulled, verified served copy and the PEFT config of its manifest, as `save_pretrained` lays them
out), and `LlmAdapters`, which keeps the newest revisions of an adapter model loaded in an
in-process `LLM` (`enable_lora=True`). vLLM is never imported here: the `LLM` is duck-typed, and a
`LoRARequest` class is passed in (or imported lazily, in the caller's environment)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from weightsvc.client import InferenceClient
from weightsvc.errors import subject
from weightsvc.integrations._common import Mismatch
from weightsvc.protocol.adapter import revision
from weightsvc.protocol.manifest import Manifest

__all__ = ["PEFT_CONFIG", "PEFT_WEIGHTS", "LlmAdapters", "write_revision"]

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def write_revision(client: InferenceClient, manifest: Manifest, root: Path) -> Path:
    """`root/MODEL@vN` holding the version's served copy (pulled, checksums verified) and its PEFT
    config; written beside it first and renamed, so that a directory of that name is always whole."""
    assert manifest.adapter is not None
    name = revision(manifest.model, manifest.version)
    where, staging = root / name, root / f".{name}.partial"
    for d in (where, staging):  # (half-written by a process that was killed)
        shutil.rmtree(d, ignore_errors=True)
    staging.mkdir(parents=True)
    client.pull_file(staging / PEFT_WEIGHTS, manifest.model, manifest.version)
    (staging / PEFT_CONFIG).write_text(json.dumps(manifest.adapter.peft_config()))
    staging.rename(where)
    return where


class LlmAdapters:
    """The newest `max_live` versions of adapter model `model` as LoRA adapters of an in-process
    vLLM `LLM`, each named `MODEL@vN`:

        adapters = LlmAdapters(llm, "weightsvc:50051", "policy-lora", max_live=2, adapter_dir=tmp)
        adapters.update()                                   # the latest version, acked once loaded
        llm.generate(prompts, params, lora_request=adapters.request())      # the newest, or request(N)

    An `LLM` runs one `generate` at a time, so an older revision goes (from the engine and from
    disk) as soon as it falls out of the window."""

    def __init__(self, llm: Any, target: str, model: str, *, adapter_dir: Path, max_live: int = 2,
                 client_id: str | None = None, lora_request: Any = None) -> None:
        if max_live < 1:
            raise ValueError(f"max_live {max_live} must be at least 1")
        if lora_request is None:
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest
        self.llm, self.target, self.model, self.root = llm, target, model, adapter_dir
        self.max_live, self.client_id, self._request = max_live, client_id, lora_request
        self.live: dict[int, Any] = {}  # version -> its LoRARequest
        self._next_id = 1 + max(llm.llm_engine.list_loras(), default=0)

    def request(self, version: int | None = None) -> Any:
        """The `LoRARequest` of a live revision (None: the newest)."""
        v = max(self.live) if version is None else version
        if v not in self.live:
            raise KeyError(f"{subject(self.model, v)} is not loaded (live: {sorted(self.live)})")
        return self.live[v]

    def update(self, version: int | str = "latest") -> int:
        """Load a version as a revision (if it is not one already), ack it, and drop the revisions
        beyond the newest `max_live`; returns the version. A version that is no adapter, or whose
        base is not the engine's model, raises `Mismatch` before anything is loaded."""
        with InferenceClient(self.target) as client:
            m = client.manifest(self.model, version)
            if m.version not in self.live:
                self._check(m)
                path = write_revision(client, m, self.root)
                request = self._request(revision(self.model, m.version), self._next_id, str(path))
                self._next_id += 1
                if not self.llm.llm_engine.add_lora(request):
                    shutil.rmtree(path, ignore_errors=True)
                    raise RuntimeError(f"{subject(self.model, m.version)}: the engine did not add it")
                self.live[m.version] = request
            client.ack(self.model, m.version, self.client_id)
        for old in sorted(self.live)[: max(0, len(self.live) - self.max_live)]:
            request = self.live.pop(old)
            self.llm.llm_engine.remove_lora(request.lora_int_id)
            shutil.rmtree(Path(request.lora_path), ignore_errors=True)
        return m.version

    def _check(self, m: Manifest) -> None:
        where = subject(m.model, m.version)
        if m.adapter is None:
            raise Mismatch(f"{where} is not an adapter version (its manifest names no base)")
        config = getattr(self.llm, "model_config", None) or self.llm.llm_engine.model_config
        served = str(getattr(config, "served_model_name", "") or "")
        bases = {str(config.model), Path(str(config.model)).name, served} - {""}
        if m.adapter.base_model not in bases:
            raise Mismatch(f"{where}: its base is {m.adapter.base_model!r}; the engine serves {sorted(bases)}")
