"""FSDP2: each rank's shard of the fp32 masters Fair Cast before the all-gather, so the gathered
weights every forward runs on are the service's served copy, and the all-gather moves bf16.

    served = served_params(model, ExportSpec("bf16", "sr", seed=0))    # before fully_shard
    for layer in model.layers:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mp_policy=...)
    for step in steps:
        served.version = step                 # the version whose served copy the forward runs on
        loss = objective(model(batch)); loss.backward(); optimizer.step()
        learner.push(step + 1, rank_shards(model), rank=rank, world_size=ranks)   # each rank its rows

Or, with `serve --nixl`, each rank publishes the served copy itself (no fp32 on the wire): its rows of
the copy the next all-gather serves, rounded by the same call the all-gather makes, before the forward
runs on it:

    for step in steps:
        served.version = step
        learner.publish(step, rank_served(model, version=step), rank=rank, world_size=ranks,
                        spec=served.spec, tied={"lm_head.weight": "model.embed_tokens.weight"},
                        masters=rank_shards(model), lag=rank_lag)   # rank_lag = RankLag(), once per run
        loss = objective(model(batch)); loss.backward(); optimizer.step()

(`masters=` and `lag=` are the version's lag: each rank measures its rows of the masters against the
served rows it publishes, and the service adds the ranks' sums up.)

Through FSDP2's extension point: each parameter's local tensor is a `ServedShard`, a tensor subclass
whose `fsdp_pre_all_gather` rounds the shard it holds with the keys of the whole tensor (its name,
and the flat index of each element in the whole tensor: a rank's rows start at
rank * ceil(rows / ranks)), and whose `fsdp_post_all_gather` hands the gathered served copy to the
forward in the parameter dtype. The unsharded parameter's gradient is reduce-scattered into the
master's, as for any FSDP parameter: the gradient at the served weights, straight to the masters.

bf16 and fp16 only: the scaled formats' scales come from the whole tensor (its amax, or a 128x128
block's, across the ranks' rows) and would need a reduction before the all-gather and the scales
gathered beside the codes; `ef` reads a residual that must advance once per version, not once per
all-gather. Both are refused when the parameters are wrapped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from weightsvc.client import Shard
from weightsvc.rounding import FORMATS, ExportSpec, fair_cast

__all__ = ["ServedShard", "ServedVersion", "rank_served", "rank_shards", "served_params"]


@dataclass
class ServedVersion:
    """What every shard of a model rounds with: the service's spec, and the version (step) the
    next all-gather serves; set `version` each step."""

    spec: ExportSpec
    version: int = 0

    @property
    def dtype(self) -> torch.dtype:
        """The served copy's dtype (bf16 or fp16: one element per master element, unscaled)."""
        return getattr(torch, FORMATS[self.spec.format].torch_dtype)  # type: ignore[no-any-return]


# The ops FSDP runs on a parameter while it shards it, whose results stay shards of the same tensor.
_KEEP = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


class ServedShard(torch.Tensor):
    """A master (or a rank's shard of it, under FSDP) that all-gathers as its served copy."""

    _data: torch.Tensor
    tensor_name: str
    served: ServedVersion

    @staticmethod
    def __new__(cls, data: torch.Tensor, name: str, served: ServedVersion) -> ServedShard:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[no-any-return]
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, name: str, served: ServedVersion) -> None:
        self._data = data
        self.tensor_name = name
        self.served = served

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ServedShard({self.tensor_name!r}, {list(self.shape)}, version {self.served.version})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, ServedShard))
        if func == torch.ops.aten.detach.default:
            return ServedShard(args[0]._data.detach(), first.tensor_name, first.served)
        plain_args, plain_kwargs = pytree.tree_map_only(ServedShard, lambda t: t._data, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func not in _KEEP:
            return out  # (the optimizer's arithmetic: plain tensors; in-place ops wrote into _data)
        return pytree.tree_map(
            lambda x: ServedShard(x, first.tensor_name, first.served) if type(x) is torch.Tensor else x, out)

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_data"], {"tensor_name": self.tensor_name, "served": self.served}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: dict[str, Any], outer_size: Any,
                             outer_stride: Any) -> ServedShard:
        return ServedShard(inner["_data"], meta["tensor_name"], meta["served"])

    def served_rows(self, offset: int) -> torch.Tensor:
        """The served copy of the master elements this holds, the first at flat index `offset` of the
        whole tensor: Fair Cast with the whole tensor's keys and the version the handle serves now."""
        spec = self.served.spec
        return fair_cast(self._data, format=spec.format, rounding=spec.rounding, seed=spec.seed,
                         version=self.served.version, name=self.tensor_name, offset=offset)

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's shard, served: rounded with the whole tensor's keys, padded as FSDP pads it."""
        ranks, rank = mesh.size(), mesh.get_local_rank()
        rows = -(-outer_size[0] // ranks) if len(outer_size) else 1  # FSDP's dim-0 chunk of every rank
        if tuple(self._data.shape[1:]) != tuple(outer_size[1:]) or self._data.shape[0] > rows:
            raise ValueError(f"tensor {self.tensor_name!r}: shard {list(self.shape)} of {list(outer_size)} is not a "
                             "dim-0 shard (Fair Cast keys elements by their flat index in the whole tensor)")
        served_dtype = self.served.dtype
        wanted = getattr(mp_policy, "param_dtype", None) or self._data.dtype
        if wanted not in (served_dtype, torch.float32, torch.float64):
            raise ValueError(f"tensor {self.tensor_name!r}: the served {self.served.spec.format} values would be "
                             f"rounded again to param_dtype {wanted}; use {served_dtype} or float32")
        shard = self.served_rows(rank * rows * math.prod(outer_size[1:]))
        padded = shard.new_zeros((rows, *outer_size[1:]))
        padded[: shard.shape[0]] = shard
        return (padded,), None

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered served copy in the parameter dtype (the served values are exact in it when it
        is as wide; bf16 with a bf16 `param_dtype`: the gathered bytes themselves)."""
        (data,) = outputs
        if out is not None:  # later all-gathers: into the unsharded parameter of the first
            if data.dtype != param_dtype:
                # (FSDP refills the parameter the forward saved for its backward, in place, as its own
                # all-gather does: `.data` leaves autograd's version counter alone)
                out.data.copy_(data.reshape(-1)[: out.numel()].view(out.shape))
            return None
        value = data if data.dtype == param_dtype else data.to(param_dtype)
        return value, (value,)


def served_params(module: nn.Module, spec: ExportSpec, *, version: int = 0) -> ServedVersion:
    """Make each parameter of `module` a `ServedShard` under its state-dict name (a tied parameter
    once, under its first name, as a push serves it), before `fully_shard`. Returns the handle whose
    `version` each all-gather serves."""
    if FORMATS[spec.format].scaled:
        raise ValueError(f"format {spec.format!r}: a scaled format's scales come from the whole tensor (an amax "
                         "across the ranks' shards, gathered beside the codes); FSDP all-gathers bf16 or fp16")
    if spec.rounding == "ef":
        raise ValueError("rounding 'ef': the served bits depend on a residual that advances once per version, not "
                         "per all-gather; run on the pulled served copy (served_weights) instead")
    served = ServedVersion(spec, version)
    wrapped: dict[int, nn.Parameter] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, param in list(owner._parameters.items()):
            if param is None:
                continue
            if id(param) not in wrapped:
                name = f"{prefix}.{attr}" if prefix else attr
                wrapped[id(param)] = nn.Parameter(ServedShard(param.data, name, served),
                                                  requires_grad=param.requires_grad)
            owner._parameters[attr] = wrapped[id(param)]
    return served


class _RankPart(NamedTuple):
    """A parameter as this rank holds it."""

    name: str
    local: torch.Tensor  # this rank's local tensor (a `ServedShard` once `served_params` wrapped it)
    offset: int  # the flat index of its first element in the whole tensor
    shape: tuple[int, ...]  # the whole tensor's
    whole: bool  # this rank sends the tensor whole (replicated or plain: rank 0 only)
    mine: bool  # this rank sends its part (whole, or its rows: possibly none); else another rank sends it all


def _rank_parts(module: nn.Module) -> Iterator[_RankPart]:
    """Each parameter of `module` once (a tied one under its first name), as this rank holds it: FSDP2's
    `Shard(0)` rows of rank r start at r * ceil(rows / ranks); a replicated or plain one is rank 0's."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DimShard

    seen: set[int] = set()
    for name, param in module.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        shape = tuple(param.shape)
        if not isinstance(param, DTensor):
            first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
            yield _RankPart(name, param.detach(), 0, shape, first, first)
            continue
        placements = tuple(param.placements)
        local = param.to_local().detach()
        if all(isinstance(p, Replicate) for p in placements):
            first = param.device_mesh.get_rank() == 0
            yield _RankPart(name, local, 0, shape, first, first)
            continue
        if len(placements) != 1 or placements != (DimShard(0),):
            raise ValueError(f"tensor {name!r}: placements {placements} are not FSDP2's Shard(0) on a 1-D mesh "
                             "(a rank's part must be whole rows to be a flat element range)")
        ranks, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
        rows = -(-shape[0] // ranks)
        offset = min(rank * rows * math.prod(shape[1:]), math.prod(shape))  # (a rank past the last row: none)
        yield _RankPart(name, local, offset, shape, False, True)


def rank_shards(module: nn.Module) -> dict[str, Shard | torch.Tensor]:
    """This rank's part of every master of an FSDP2 `module`, to push as one rank of a version:

        learner.push(step, rank_shards(model), rank=dist.get_rank(), world_size=dist.get_world_size(),
                     tied={"lm_head.weight": "model.embed_tokens.weight"})

    A parameter sharded on dim 0 (FSDP2's `Shard(0)`) gives the flat elements of its rows (`Shard`:
    FSDP's rows of rank r start at r * ceil(rows / ranks)); a rank with no rows of it gives none; a
    replicated one (a DTensor of `Replicate()` placements, or a plain tensor) is pushed whole by rank 0
    only. Tied parameters count once, under their first name (declare the tie with `tied`)."""
    out: dict[str, Shard | torch.Tensor] = {}
    for part in _rank_parts(module):
        master = part.local._data if isinstance(part.local, ServedShard) else part.local
        if part.whole:
            out[part.name] = master
        elif part.mine and master.numel():
            out[part.name] = Shard(master.reshape(-1), part.offset, part.shape)
    return out


def rank_served(module: nn.Module, *, version: int) -> dict[str, Shard | torch.Tensor]:
    """This rank's part of the served copy of `version` of a `module` wrapped by `served_params` (and
    FSDP2), to publish as one rank of that version:

        served.version = step
        learner.publish(step, rank_served(model, version=step), rank=dist.get_rank(),
                        world_size=dist.get_world_size(), spec=served.spec,
                        tied={"lm_head.weight": "model.embed_tokens.weight"})

    The bytes are those the all-gather serves while `served.version` is `version` and the masters are
    as they are now: each rank's rows rounded by the same call (`ServedShard.served_rows`, the whole
    tensor's keys). So take it after setting the version and before the optimizer step that moves the
    masters; a handle at another version is refused, naming the tensor and both versions.

    A parameter sharded on dim 0 gives this rank's rows as a `Shard` of the served dtype (an empty one
    where the rank holds no rows: every rank of a publish declares every tensor); a replicated or plain
    one is given whole by rank 0 and as an empty `Shard` by the others. Tied parameters count once,
    under their first name: declare the tie with `publish(..., tied=)` on every rank. The tensors are on
    the masters' device; publish takes them from host memory."""
    spec: ExportSpec | None = None
    out: dict[str, Shard | torch.Tensor] = {}
    for part in _rank_parts(module):
        local = part.local
        if not isinstance(local, ServedShard):
            raise ValueError(f"tensor {part.name!r}: not a served parameter (wrap the module with served_params "
                             "before fully_shard): its served copy is not the one the all-gather makes")
        handle = local.served
        if handle.version != version:
            raise ValueError(f"tensor {part.name!r}: its all-gather serves version {handle.version}, not {version}; "
                             f"set served.version = {version} before taking the served copy of version {version}")
        if spec is not None and handle.spec != spec:
            raise ValueError(f"tensor {part.name!r}: served with {handle.spec}, the module's other tensors with "
                             f"{spec} (one version has one spec)")
        spec = handle.spec
        if part.whole:
            out[part.name] = local.served_rows(0)
        elif part.mine and local.numel():
            out[part.name] = Shard(local.served_rows(part.offset).reshape(-1), part.offset, part.shape)
        else:
            out[part.name] = Shard(torch.empty(0, dtype=handle.dtype, device=local.device), part.offset, part.shape)
    return out
