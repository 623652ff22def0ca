"""Any torch module (an HF transformers model included): loaded in place, each value cast to its
parameter's dtype and device.

    update_module(model, "weightsvc:50051", "policy")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from weightsvc.client import InferenceClient, dequantize
from weightsvc.integrations._common import Mismatch, update
from weightsvc.protocol.manifest import Manifest

__all__ = ["LoadResult", "dequantize", "load_into", "update_module"]


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


def _memory(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.stride()


def load_into(module: torch.nn.Module, served: Mapping[str, torch.Tensor], *, strict: bool = True) -> LoadResult:
    """Copy a served copy into `module` in place; each value is cast to its entry's dtype and device.

    Everything is checked before anything is copied: a shape that differs raises `Mismatch` naming
    the tensor, and so does, with `strict`, a name the module lacks or a module entry the served
    copy lacks. Entries the module ties (they share memory, as a head tied to the embeddings does)
    need only one of their names. Without `strict`, the result lists missing and unexpected names."""
    values = dequantize(served)
    state = module.state_dict()  # detached views of the parameters and buffers
    by_memory: dict[tuple[Any, ...], list[str]] = {}
    for key, t in state.items():
        by_memory.setdefault(_memory(t), []).append(key)
    source: dict[str, str] = {}  # module entry -> served name
    missing: list[str] = []
    for key, t in state.items():
        name = key if key in values else next((k for k in by_memory[_memory(t)] if k in values), None)
        if name is None:
            missing.append(key)
            continue
        if tuple(values[name].shape) != tuple(t.shape):
            raise Mismatch(f"tensor {name!r} has shape {list(values[name].shape)}; the module expects "
                           f"{list(t.shape)} for {key!r}")
        source[key] = name
    objects = {id(v) for k, v in values.items() if k in state}
    unexpected = [k for k, v in values.items() if k not in state and id(v) not in objects]  # aliases are not
    if strict and (missing or unexpected):
        raise Mismatch(
            "the served copy does not fit the module: "
            + "; ".join(
                [f"missing {k!r} (shape {list(state[k].shape)})" for k in missing[:5]]
                + [f"unexpected {k!r} (shape {list(values[k].shape)})" for k in unexpected[:5]]
            )
        )
    written: set[tuple[Any, ...]] = set()
    with torch.no_grad():
        for key, name in source.items():
            where = _memory(state[key])
            if where not in written:  # tied entries are written once
                state[key].copy_(values[name])
                written.add(where)
    return LoadResult(missing, unexpected)


def update_module(
    module: torch.nn.Module,
    target: str,
    model: str = "default",
    version: int | str = "latest",
    *,
    client_id: str | None = None,
    strict: bool = True,
) -> int:
    """Pull a version into a torch module (an HF transformers model included) and ack it; returns it.
    The whole version is pulled and verified before `load_into` writes any of it. A version of a LoRA
    adapter goes into a PEFT `PeftModel` by PEFT's hot-swap (`weightsvc.integrations.peft.load_adapter`)."""
    def load(client: InferenceClient, m: Manifest) -> object:
        served = client.pull(model, m.version)
        if m.adapter is not None:
            from weightsvc.integrations.peft import load_adapter

            load_adapter(module, served, m)
            return None
        return load_into(module, served, strict=strict)

    return update(target, model, version, client_id, load)
