"""LoRA adapters with HF PEFT: what a learner pushes of a `PeftModel`, the served copy it trains on
(computed locally, bit for bit the service's), and a served version hot-swapped into a `PeftModel`.

    tensors, adapter = adapter_state(peft_model, base_model="policy-base")
    learner.push(step, tensors, model="policy-lora", adapter=adapter)
    served = served_adapter(tensors, ExportSpec("bf16", "sr"), version=step)   # what the fleet runs
    update_adapter(peft_model, "weightsvc:50051", "policy-lora")             # another PeftModel follows
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from weightsvc import rounding
from weightsvc.errors import subject
from weightsvc.integrations._common import Mismatch, update
from weightsvc.protocol.adapter import Adapter
from weightsvc.protocol.manifest import Manifest

__all__ = ["adapter_state", "load_adapter", "served_adapter", "update_adapter"]


def adapter_state(peft_model: Any, adapter_name: str = "default", *, base_model: str | None = None,
                  base_version: int = 0, base_digest: str = "") -> tuple[dict[str, torch.Tensor], Adapter]:
    """The adapter's fp32 masters under PEFT's names (as `save_pretrained` writes them) and its
    `Adapter`: the base (default: the config's `base_model_name_or_path`) and the PEFT config."""
    from peft import get_peft_model_state_dict

    config = peft_model.peft_config[adapter_name]
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise ValueError(f"adapter {adapter_name!r} is a {config.peft_type} adapter; only LoRA is pushed as versions")
    if config.rank_pattern or config.alpha_pattern or config.use_rslora or config.use_dora:
        raise ValueError(f"adapter {adapter_name!r}: rank or alpha patterns, rsLoRA and DoRA are not served here "
                         "(one rank and one alpha for every module)")
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    masters = {name: t.detach().float() for name, t in state.items()}
    base = base_model if base_model is not None else str(config.base_model_name_or_path or "")
    return masters, Adapter(base, int(config.r), float(config.lora_alpha), tuple(sorted(config.target_modules)),
                            base_version, base_digest)


def served_adapter(masters: Mapping[str, torch.Tensor], spec: rounding.ExportSpec,
                   version: int) -> dict[str, torch.Tensor]:
    """The served copy of an adapter version, computed here: bit for bit what the service serves for
    these masters pushed as `version` under `spec` (an adapter is served unscaled: `spec.unscaled()`).
    With `ef` this is the first version's copy only (the residual lives in the service)."""
    return rounding.export_state_dict(dict(masters), spec.unscaled(), version=version)


def _check_fits(peft_model: Any, adapter_name: str, manifest: Manifest) -> Any:
    """The PEFT config of `adapter_name`, after refusing (Mismatch, by name) a version that is no
    adapter or whose rank, alpha or target modules differ from it."""
    where = subject(manifest.model, manifest.version)
    a = manifest.adapter
    if a is None:
        raise Mismatch(f"{where} is not an adapter version (its manifest names no base and no PEFT config)")
    config = peft_model.peft_config[adapter_name]
    mine = (int(config.r), float(config.lora_alpha), tuple(sorted(config.target_modules)))
    if (a.rank, a.alpha, tuple(sorted(a.target_modules))) != mine:
        raise Mismatch(f"{where}: adapter rank {a.rank} alpha {a.alpha} target modules {sorted(a.target_modules)}; "
                       f"the PeftModel's adapter {adapter_name!r} has rank {mine[0]} alpha {mine[1]} target "
                       f"modules {list(mine[2])}")
    return config


def load_adapter(peft_model: Any, served: Mapping[str, torch.Tensor], manifest: Manifest,
                 adapter_name: str = "default") -> None:
    """Hot-swap a served adapter version into `peft_model` in place (PEFT's
    `hotswap_adapter_from_state_dict`), each tensor cast to its parameter's dtype. Everything is
    checked first: the config, and each tensor's name and shape (Mismatch names the first that
    differs); nothing is written when a check fails."""
    from peft.utils.hotswap import hotswap_adapter_from_state_dict

    config = _check_fits(peft_model, adapter_name, manifest)
    params = dict(peft_model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for name, value in served.items():
        key = name.replace(".lora_A.weight", f".lora_A.{adapter_name}.weight").replace(
            ".lora_B.weight", f".lora_B.{adapter_name}.weight")
        if key not in params:
            raise Mismatch(f"{subject(manifest.model, manifest.version)}: tensor {name!r} adapts no module "
                           f"of the PeftModel's adapter {adapter_name!r}")
        if tuple(value.shape) != tuple(params[key].shape):
            raise Mismatch(f"{subject(manifest.model, manifest.version)}: tensor {name!r} has shape "
                           f"{list(value.shape)}; the PeftModel expects {list(params[key].shape)}")
        state[key] = value
    mine = {k for k in params if f".{adapter_name}." in k and ".lora_" in k}
    if mine - set(state):
        missing = sorted(mine - set(state))[0]
        raise Mismatch(f"{subject(manifest.model, manifest.version)} lacks {missing!r} of the PeftModel")
    with torch.no_grad():
        hotswap_adapter_from_state_dict(peft_model, state, adapter_name, config)


def update_adapter(peft_model: Any, target: str, model: str, version: int | str = "latest", *,
                   adapter_name: str = "default", client_id: str | None = None) -> int:
    """Pull an adapter version (whole, verified) into `peft_model` by `load_adapter`, and ack it;
    returns the version."""
    return update(target, model, version, client_id,
                  lambda client, m: load_adapter(peft_model, client.pull(model, m.version), m, adapter_name))
