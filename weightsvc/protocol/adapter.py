"""A LoRA adapter version: the base model it applies to, and its PEFT config.

An adapter model's versions hold PEFT's tensors under PEFT's names (`...q_proj.lora_A.weight`, shape
(rank, in); `...q_proj.lora_B.weight`, shape (out, rank)); the learner's push header declares what
they adapt, the service checks the tensors against it and records it in the manifest, and an engine
refuses by name a version whose base or config does not fit it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightsvc.errors import InvalidArgument
from weightsvc.protocol.refs import MAX_STEP

__all__ = ["Adapter", "parse_revision", "revision"]

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")
MAX_RANK = 4096
MAX_TARGETS = 256


@dataclass(frozen=True)
class Adapter:
    base_model: str  # the base the adapter applies to: a weightsvc model or a checkpoint's name
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # PEFT's: module name suffixes (q_proj, v_proj, ...)
    base_version: int = 0  # the base's weightsvc version; 0: not a weightsvc version
    base_digest: str = ""  # the base checkpoint's digest (a weightsvc master_digest, or the owner's)

    def to_dict(self) -> dict[str, Any]:
        return {"base_model": self.base_model, "base_version": self.base_version, "base_digest": self.base_digest,
                "rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Adapter:
        return cls(str(d["base_model"]), int(d["rank"]), float(d["alpha"]), tuple(d["target_modules"]),
                   int(d.get("base_version", 0)), str(d.get("base_digest", "")))

    def peft_config(self) -> dict[str, Any]:
        """The `adapter_config.json` PEFT and vLLM read this adapter by."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": sorted(self.target_modules), "base_model_name_or_path": self.base_model,
                "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False,
                "use_dora": False, "modules_to_save": None, "inference_mode": True}

    def check(self, where: str, tensors: Iterable[tuple[str, tuple[int, ...]]], whole: bool = True) -> None:
        """Refuse (InvalidArgument, naming the tensor and the rule) a config that cannot be one, or
        tensors that are not this adapter's: PEFT LoRA names of target modules, A (rank, in) and
        B (out, rank) of each module, and (`whole`: all the version's tensors) both of them."""
        bad = f"{where}: adapter of base {self.base_model!r}"
        if not self.base_model:
            raise InvalidArgument(f"{where}: an adapter names its base model", reason="invalid_header")
        if not 1 <= self.rank <= MAX_RANK:
            raise InvalidArgument(f"{bad}: rank {self.rank} is not in [1, {MAX_RANK}]", reason="invalid_header")
        if not (self.alpha > 0 and self.alpha < float("inf")):
            raise InvalidArgument(f"{bad}: alpha {self.alpha} is not a positive number", reason="invalid_header")
        if not 1 <= len(self.target_modules) <= MAX_TARGETS or not all(self.target_modules):
            raise InvalidArgument(f"{bad}: target_modules {list(self.target_modules)} must name 1-{MAX_TARGETS} "
                                  "modules", reason="invalid_header")
        if not 0 <= self.base_version <= MAX_STEP:
            raise InvalidArgument(f"{bad}: base_version {self.base_version} is not a version", reason="invalid_header")
        sides: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, shape in tensors:
            m = _LORA.match(name)
            if m is None:
                raise InvalidArgument(f"{bad}: tensor {name!r} is not a LoRA weight (PEFT's names end in "
                                      "'.lora_A.weight' or '.lora_B.weight')", reason="invalid_header")
            module = m["module"]
            if module.rpartition(".")[2] not in self.target_modules:
                raise InvalidArgument(f"{bad}: tensor {name!r} adapts a module outside target_modules "
                                      f"{sorted(self.target_modules)}", reason="invalid_header")
            if len(shape) != 2 or (shape[0] if m["side"] == "A" else shape[1]) != self.rank:
                raise InvalidArgument(f"{bad}: tensor {name!r} has shape {list(shape)}; lora_A is (rank, in) and "
                                      f"lora_B (out, rank), rank {self.rank}", reason="invalid_header")
            sides.setdefault(module, {})[m["side"]] = shape
        for module, pair in sides.items() if whole else ():  # (a sharded replica holds some of them)
            if len(pair) != 2:
                lacking = "B" if "A" in pair else "A"
                raise InvalidArgument(f"{bad}: module {module!r} has no lora_{lacking}.weight",
                                      reason="invalid_header")


def revision(model: str, version: int) -> str:
    """The name an engine serves a version of an adapter model under: `MODEL@vN`."""
    return f"{model}@v{version}"


def parse_revision(name: str) -> tuple[str, int] | None:
    """(model, version) of a revision name `MODEL@vN`; None for any other name."""
    model, at, v = name.rpartition("@v")
    return (model, int(v)) if at and model and v.isdigit() else None
