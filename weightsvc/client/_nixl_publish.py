"""A learner rank's publish over NIXL: its served tensors (or its shards of them) registered with this
process's agent while the service READs them, the checksum of each, and the request that says where
they lie (`protocol.published`). The memory stays registered, and must stay unchanged, until the
service has answered: the caller's buffers are then free again.

The tensors are torch tensors in host memory, contiguous, in their served dtype: what
`weightsvc.integrations.fair_cast.served_state_dict` makes (the learner's own export, bit for bit the
service's under the same spec).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from weightsvc.errors import InvalidArgument
from weightsvc.protocol.digest import checksum
from weightsvc.protocol.fabric import MemoryRange, SharedAgent, new_agent
from weightsvc.protocol.published import MAX_REQUEST_BYTES, PublishedTensor, RankPublish
from weightsvc.rounding import ExportSpec

if TYPE_CHECKING:
    import torch

_AGENT: SharedAgent | None = None  # one NIXL agent per process for publishes, made at the first
_MAKING = threading.Lock()


def _agent() -> SharedAgent:
    """This process's agent for publishes. Ranks that publish from threads of one process share it: each
    registers its own memory, and the metadata it sends names it (and whatever else is registered)."""
    global _AGENT
    with _MAKING:
        if _AGENT is None:
            _AGENT = SharedAgent(new_agent(f"weightsvc-learner-{os.getpid()}-{secrets.token_hex(4)}"))
        return _AGENT


def _safetensors_dtype(name: str, t: torch.Tensor) -> str:
    from weightsvc.client._tensors import TORCH_DTYPES

    for dtype, torch_dtype in TORCH_DTYPES.items():
        if t.dtype == torch_dtype:
            return dtype
    raise TypeError(f"tensor {name!r} is {t.dtype}: publish the served copy (its served dtypes)")


# A served tensor as the caller holds it: (its bytes, the flat offset of its first element, the whole
# tensor's shape); the shape None: the tensor itself, whole.
Held = tuple[Any, int, "tuple[int, ...] | None"]


def _flat(name: str, held: Held) -> tuple[torch.Tensor, int, tuple[int, ...], bool]:
    """(the bytes' tensor, flat offset, whole shape, whether it is a part) of a tensor or a shard of it."""
    torch = sys.modules.get("torch")
    data, offset, shape = held
    if torch is None or not isinstance(data, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(data).__name__}: publish torch tensors (or Shards of them)")
    if data.device.type != "cpu" or not data.is_contiguous():
        raise InvalidArgument(f"tensor {name!r}: publish contiguous tensors in host memory (it is on {data.device}"
                              f"{'' if data.is_contiguous() else ', not contiguous'})")
    if shape is not None:
        numel = math.prod(shape)
        if offset < 0 or offset + data.numel() > numel:
            raise ValueError(f"shard of tensor {name!r}: elements [{offset}, {offset + data.numel()}) are not within "
                             f"its shape {list(shape)} ({numel} elements)")
        return data, offset, shape, True
    return data, 0, tuple(data.shape), False


@contextlib.contextmanager
def published(served: Mapping[str, Held], *, model: str, step: int, rank: int, world_size: int, spec: ExportSpec,
              master_digest: str, aliases: Mapping[str, str]) -> Iterator[RankPublish]:
    """The rank's request, its tensors registered with this process's agent until the block ends."""
    import torch

    tensors: list[PublishedTensor] = []
    regions: list[tuple[int, int, int, str]] = []
    for name, held in served.items():
        data, offset, shape, part = _flat(name, held)
        raw = data.detach().reshape(-1).view(torch.uint8)
        nbytes = raw.numel()
        ranges = (MemoryRange(raw.data_ptr(), nbytes, 0),) if nbytes else ()
        if nbytes:
            regions.append((raw.data_ptr(), nbytes, 0, ""))
        tensors.append(PublishedTensor(name, shape, _safetensors_dtype(name, data),
                                       (offset, data.numel()) if part else None, checksum(raw.numpy()), ranges))
    agent = _agent()
    registered = agent.register_memory(regions, "DRAM") if regions else None
    try:
        yield RankPublish(model, step, rank, world_size, spec, agent.get_agent_metadata(), "DRAM", tuple(tensors),
                          master_digest, tuple(sorted(aliases.items())))
    finally:
        if registered is not None:
            agent.deregister_memory(registered)


def check_size(request_bytes: int, where: str, tensors: int, limit: int = MAX_REQUEST_BYTES) -> None:
    """INVALID_ARGUMENT when a publish's request is over the message limit: one message carries it."""
    if request_bytes > limit:
        raise InvalidArgument(f"{where}: the publish request of {tensors} tensors takes {request_bytes} bytes, over "
                              f"the {limit} a message may have: publish fewer tensors a rank (more ranks), or push")

