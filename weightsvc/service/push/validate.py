"""A push header's checks, before the push joins anything: names, steps, ranks, owners and sizes."""

from __future__ import annotations

from collections.abc import Iterable

from weightsvc.errors import InvalidArgument, ResourceExhausted, subject
from weightsvc.protocol.manifest import DTYPE_SIZES, MASTER_DTYPE
from weightsvc.protocol.refs import MAX_STEP, check_model_name, check_tensor_name
from weightsvc.protocol.safetensors import check_header_size
from weightsvc.service.push.messages import PushHeader
from weightsvc.service.push.shards import MAX_WORLD_SIZE
from weightsvc.settings import Settings


def check_ranks(model: str, step: int, rank: int, world_size: int) -> str:
    """Refuse a model name, step, rank or world size out of range (a push's or a publish's); answers
    how messages name the version (`subject`)."""
    check_model_name(model)
    where = subject(model, step=step)
    if not 0 <= step <= MAX_STEP:
        raise InvalidArgument(f"{where}: step must be in [0, {MAX_STEP}]", reason="invalid_header")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(f"{where}: world_size {world_size} is not in [1, {MAX_WORLD_SIZE}]",
                              reason="invalid_header")
    if not 0 <= rank < world_size:
        raise InvalidArgument(f"{where}: rank {rank} is outside world_size {world_size}", reason="invalid_header")
    return where


def missing_ranks(world_size: int, present: Iterable[int]) -> str:
    """The ranks of `world_size` not in `present`, as a refusal lists them (the first ten)."""
    missing = sorted(set(range(world_size)) - set(present))
    return ", ".join(map(str, missing[:10])) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")


def validate_header(header: PushHeader, settings: Settings) -> None:
    """Refuse a header that breaks a rule of its own or a limit of `settings` (linear in its tensors)."""
    where = check_ranks(header.model, header.step, header.rank, header.world_size)
    if header.owners:
        if len(set(header.owners)) != len(header.owners) or not all(header.owners):
            raise InvalidArgument(f"{where}: owners {list(header.owners)} must be distinct replica ids",
                                  reason="invalid_header")
        if not 1 <= header.replication <= len(header.owners):
            raise InvalidArgument(f"{where}: replication {header.replication} is not in [1, {len(header.owners)}] "
                                  f"(the number of owners)", reason="invalid_header")
    elif not header.tensors:  # (a sharded replica may own none of a version's tensors)
        raise InvalidArgument(f"{where}: the push declares no tensors", reason="invalid_header")
    if len(header.tensors) > settings.max_tensors:
        raise ResourceExhausted(
            f"{where}: {len(header.tensors)} tensors, more than the {settings.max_tensors} a version may have "
            "(--max-tensors)",
            reason="too_large",
        )
    seen: set[str] = set()
    total = 0
    for t in header.tensors:
        check_tensor_name(where, t.name, seen)
        if t.dtype not in DTYPE_SIZES:
            raise InvalidArgument(
                f"{where}: tensor {t.name!r} has unknown dtype {t.dtype!r} (known: {', '.join(DTYPE_SIZES)})",
                reason="invalid_header",
            )
        if t.dtype != MASTER_DTYPE:
            raise InvalidArgument(
                f"{where}: tensor {t.name!r} is {t.dtype}; masters are pushed as {MASTER_DTYPE}",
                reason="invalid_header",
            )
        if any(d < 0 for d in t.shape):
            raise InvalidArgument(
                f"{where}: tensor {t.name!r} has a negative dimension in shape {list(t.shape)}",
                reason="invalid_header",
            )
        if t.part is not None and (min(t.part) < 0 or sum(t.part) > t.numel):
            raise InvalidArgument(
                f"{where}: tensor {t.name!r}: part [{t.part[0]}, {sum(t.part)}) is not within its {t.numel} elements "
                f"(shape {list(t.shape)})",
                reason="invalid_header",
            )
        nbytes = t.numel * DTYPE_SIZES[t.dtype]
        if nbytes > settings.max_tensor_bytes:
            raise ResourceExhausted(
                f"{where}: tensor {t.name!r} of shape {list(t.shape)} holds {nbytes} bytes, more than the "
                f"{settings.max_tensor_bytes} bytes a tensor may have (--max-tensor-bytes)",
                reason="too_large",
            )
        total += nbytes
        if total > settings.max_version_bytes:
            raise ResourceExhausted(
                f"{where}: the masters declared up to tensor {t.name!r} already hold {total} bytes, more "
                f"than the {settings.max_version_bytes} bytes a version may have (--max-version-bytes)",
                reason="too_large",
            )
    # Each tensor is in the file header twice (its entry and the manifest): a lower bound, so that a
    # header certain to be too big is refused now, not after its bytes arrived (commit checks exactly).
    check_header_size(sum(2 * len(t.name) + 150 for t in header.tensors), where)
    for alias, target in header.aliases:
        if alias in seen:
            raise InvalidArgument(f"{where}: alias {alias!r} (of {target!r}) is also a tensor of the push",
                                  reason="invalid_header")
        check_tensor_name(where, alias, seen)

