"""The learner's half of Fair Cast: its loss computed on the served copy, recomputed locally.

The served copy of a version is a pure function of the masters and the keys (seed, version, tensor
name, flat element index), so the learner computes the very bits the service serves without a pull
(`served_state_dict`), runs its forward on them with the gradients going to the fp32 masters
(`on_served_copy`), and can check its copy against the service's manifest (`check_served`):

    spec = ExportSpec("bf16", "sr", seed=0)              # the service's --format, --rounding, --seed
    for step in steps:
        with on_served_copy(policy, spec, version=step):
            loss = objective(policy(batch))
            loss.backward()                              # at the served weights, on the masters
        optimizer.step()
        learner.push(step + 1, policy.state_dict())      # serves what `on_served_copy(version=step + 1)` runs

With `ef` the served bits also depend on the residual, the service's state: the learner keeps the
same one (`Residual()`, advanced by each call, once per version and in order; saved with its
checkpoint), or runs on the copy it pulls (`weightsvc.client.served_weights`).

Why `torch.nn.utils.parametrize` (in `served_weights`) and not `torch.func.functional_call`: the
host calls the module itself (an HF `Trainer`, TRL), so the served copy must stand in for the
duration of a context, not of one call; a weight read outside `forward` (a tied head, a loss on
`lm_head.weight`) reads the served copy too; tied parameters stay one master, whose gradient sums
both uses; each forward builds its own autograd node, so gradient accumulation works; the copy is
held once, in its served dtype (bf16: half the masters). The rounding runs once per version, on
entry, never inside the forward: what a compiler traces is a cast and a straight-through
`autograd.Function`. The price under `torch.compile`: parametrizing swaps the module's class, so
a compiled module recompiles on each entry (one graph per version; past Dynamo's recompile limit it
runs eager). Under FSDP2 the served copy comes in through the all-gather instead
(`weightsvc.integrations.fsdp`), and the module is left as it is.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from weightsvc.client import InferenceClient, served_weights
from weightsvc.client._learner import untie
from weightsvc.client._tensors import _check_plain
from weightsvc.errors import subject
from weightsvc.protocol.digest import MasterDigest, checksum, masters_digest
from weightsvc.rounding import ExportSpec, Residual, export_state_dict

__all__ = ["ServedMismatch", "check_served", "masters_digest_of", "on_served_copy", "served_state_dict"]


class ServedMismatch(ValueError):
    """The learner's served copy is not the service's: a spec, the masters or the residual differ."""


def served_state_dict(module: torch.nn.Module | Mapping[str, torch.Tensor], spec: ExportSpec, *, version: int,
                      residual: Residual | None = None, device: str = "auto") -> dict[str, torch.Tensor]:
    """The served tensors of version `version` of `module`'s masters (its state dict, as
    `LearnerClient.push` sends it; or a state dict), bit for bit what the service serves under
    `spec`: same names (tied ones once, under the first name, and as aliases), formats, scales
    and rounding. With `ef`, `residual` (that of the version before) advances to `version`."""
    if isinstance(module, torch.nn.Module):
        _check_plain(module)
    state = module.state_dict() if isinstance(module, torch.nn.Module) else dict(module)
    if spec.rounding == "ef":
        if residual is None:
            raise ValueError("rounding 'ef': the served copy depends on the residual; pass the learner's Residual "
                             "(a fresh Residual() before the model's first version)")
        if residual.version is not None and version <= residual.version:
            raise ValueError(f"rounding 'ef': the residual is at version {residual.version}; version {version} "
                             "must come after it (each version advances it once)")
    kept, aliases = untie(state)
    return export_state_dict(kept, spec, version=version, residual=residual, device=device,  # type: ignore[arg-type]
                             aliases=aliases)


@contextlib.contextmanager
def on_served_copy(module: torch.nn.Module, spec: ExportSpec, *, version: int, residual: Residual | None = None,
                   dtype: torch.dtype | None = None) -> Iterator[torch.nn.Module]:
    """Run `module` on its served copy of `version` (`served_state_dict`, computed on entry from the
    masters as they are): each parameter reads as its served value, dequantized, in `dtype` (None:
    the parameter's own; `torch.bfloat16` under bf16 autocast halves what the copy holds), and
    the gradient at it lands on the fp32 master unchanged."""
    served = served_state_dict(module, spec, version=version, residual=residual)
    with served_weights(module, served, dtype=dtype) as m:
        yield m


def check_served(client: InferenceClient, model: str, version: int, module: torch.nn.Module | None = None,
                 spec: ExportSpec | None = None, *, residual: Residual | None = None,
                 served: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise `ServedMismatch`, naming what differs, unless the learner's served copy of `version`
    is the service's: the manifest's format, rounding, seed (and fp8 scaling) against `spec`, then
    each served tensor's checksum against the local bytes (`served`, or computed from `module`;
    `ef` from a copy of `residual`, which does not move). A version the service never committed
    raises its `NotFound`."""
    manifest = client.manifest(model, version)
    where = subject(model, version)
    if spec is not None:
        service = {"format": manifest.format, "rounding": manifest.rounding, "seed": manifest.seed}
        mine: dict[str, Any] = {"format": spec.format, "rounding": spec.rounding, "seed": spec.seed}
        if manifest.scaling:
            service["scaling"], mine["scaling"] = manifest.scaling, spec.scaling
        differ = [f"{k}: the service's {service[k]!r}, the learner's {mine[k]!r}"
                  for k in service if service[k] != mine[k]]
        if differ:
            raise ServedMismatch(f"{where}: the learner's export spec is not the service's ({'; '.join(differ)})")
    if served is None:
        if module is None or spec is None:
            raise ValueError("check_served: pass the served copy, or the module and its spec")
        served = served_state_dict(module, spec, version=version, residual=copy.deepcopy(residual))
    expected = {t.name: t for t in manifest.tensors}
    missing = sorted(set(expected) - set(served))
    if missing:
        raise ServedMismatch(f"{where}: the learner's copy lacks served tensors {missing[:5]}")
    local = {name for name in served if name not in dict(manifest.aliases)}
    extra = sorted(local - set(expected))
    if extra:
        raise ServedMismatch(f"{where}: the service serves no tensors {extra[:5]}")
    differ = [name for name, t in expected.items() if checksum(_bytes(served[name])) != t.checksum]
    if differ:
        if module is not None and masters_digest_of(module) != manifest.master_digest:
            why = "the learner's masters are not those pushed for this version"
        elif manifest.rounding == "ef":
            why = "the masters are those pushed: the learner's residual differs from the service's"
        else:
            why = "the masters are those pushed, the spec the same: the export differs (a different weightsvc?)"
        raise ServedMismatch(f"{where}: {len(differ)} served tensors differ from the service's bytes "
                             f"({', '.join(repr(n) for n in differ[:5])}): {why}")


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def masters_digest_of(module: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """The digest of `module`'s masters as a push of its state dict records it in the manifest
    (`master_digest`): equal to the service's when the learner holds the masters it pushed."""
    state = module.state_dict() if isinstance(module, torch.nn.Module) else dict(module)
    kept, aliases = untie(state)
    tensors = []
    for name, t in kept.items():
        data = _bytes(t.detach().to(torch.float32))  # type: ignore[union-attr]
        digest = MasterDigest(data.nbytes)
        digest.update(0, data)
        tensors.append((name, tuple(t.shape), digest.hexdigest()))
    return masters_digest(tensors, aliases.items())
