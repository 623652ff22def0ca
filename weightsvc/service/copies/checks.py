"""A publish's checks: what one rank's request must be on this server, and what the ranks must agree
on together before anything is reserved or read. Pure (linear in the tensors: off the loop for many).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from weightsvc import rounding
from weightsvc.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, subject
from weightsvc.protocol.manifest import ServedTensor, TensorSpec, layout
from weightsvc.protocol.published import PublishedTensor, RankPublish
from weightsvc.protocol.refs import check_tensor_name
from weightsvc.service.push.shards import merge_shards
from weightsvc.service.push.validate import check_ranks
from weightsvc.settings import Settings


def server_spec(settings: Settings) -> rounding.ExportSpec:
    """The export this server makes of every model's pushes (its settings)."""
    s = settings
    return rounding.ExportSpec(s.format, s.rounding, s.seed, s.scaling, s.fp8_pattern)


def check_rank(p: RankPublish, settings: Settings) -> None:
    """Refuse a rank's request that breaks a rule of its own, a limit of the server, or whose spec is
    not the server's (a copy exported otherwise is not what a push would serve)."""
    where = check_ranks(p.model, p.step, p.rank, p.world_size)
    if not p.tensors:
        raise InvalidArgument(f"{p.where}: the publish declares no tensors", reason="invalid_header")
    if len(p.tensors) > settings.max_tensors:
        raise ResourceExhausted(f"{p.where}: {len(p.tensors)} tensors, more than the {settings.max_tensors} a version "
                                "may have (--max-tensors)", reason="too_large")
    seen: set[str] = set()
    for t in p.tensors:
        check_tensor_name(where, t.name, seen)
    for alias, _ in p.aliases:
        check_tensor_name(where, alias, seen)
    p.check()
    check_spec(p, server_spec(settings))


def check_spec(p: RankPublish, server: rounding.ExportSpec) -> None:
    """FAILED_PRECONDITION naming both unless the rank exported with the server's spec (the scaling
    and the fp8 pattern count only for a scaled format)."""
    mine, theirs = _fields(p.spec), _fields(server)
    if not rounding.FORMATS[server.format].scaled:
        for key in ("scaling", "fp8_pattern"):
            mine.pop(key), theirs.pop(key)
    differ = [f"{k} {mine[k]!r} (the server's: {theirs[k]!r})" for k in theirs if mine[k] != theirs[k]]
    if differ:
        raise FailedPrecondition(f"{p.where}: the copy was exported with {'; '.join(differ)}: publish the copy this "
                                 "server serves (its --format, --rounding, --seed, --scaling, --fp8-pattern)",
                                 reason="invalid_header")


def _fields(spec: rounding.ExportSpec) -> dict[str, object]:
    return {"format": spec.format, "rounding": spec.rounding, "seed": spec.seed, "scaling": spec.scaling,
            "fp8_pattern": spec.fp8_pattern}


@dataclass(frozen=True)
class CopyPlan:
    """Where each served tensor goes in the version's data section, and the ranks' parts of it."""

    slots: dict[str, ServedTensor]  # served name -> its place (no checksum yet)
    data_bytes: int
    parts: dict[str, list[tuple[int, PublishedTensor]]]  # served name -> (rank, its part), by offset


def plan_copy(where: str, ranks: Mapping[int, RankPublish], spec: rounding.ExportSpec, max_bytes: int) -> CopyPlan:
    """The ranks' requests agreed and laid out: every rank declares the same tensors with the same
    shapes and dtypes (INVALID_ARGUMENT naming the tensor and the ranks that disagree), the same
    aliases and master digest, their parts cover each tensor exactly once, and the tensors are what
    `spec` serves of some masters (a tensor in another dtype, a missing scale: named)."""
    first_rank = min(ranks)
    first = {t.name: t for t in ranks[first_rank].tensors}
    for rank in sorted(ranks):
        p = ranks[rank]
        mine = {t.name: t for t in p.tensors}
        for name in sorted(set(first) ^ set(mine)):
            has, lacks = (first_rank, rank) if name in first else (rank, first_rank)
            raise InvalidArgument(f"{subject(p.model, step=p.step, tensor=name)}: rank {has} publishes it, rank "
                                  f"{lacks} does not (every rank declares every tensor, its part possibly empty)",
                                  reason="invalid_header")
        for name, t in mine.items():
            f = first[name]
            if (t.shape, t.dtype) != (f.shape, f.dtype):
                raise InvalidArgument(
                    f"{subject(p.model, step=p.step, tensor=name)}: rank {first_rank} declares {f.dtype} of shape "
                    f"{list(f.shape)}, rank {rank} declares {t.dtype} of shape {list(t.shape)}",
                    reason="invalid_header")
        for what, a, b in (("aliases", dict(p.aliases), dict(ranks[first_rank].aliases)),
                           ("master digest", p.master_digest, ranks[first_rank].master_digest)):
            if a != b:
                raise InvalidArgument(f"{where}: rank {rank} declares {what} {a!r}, rank {first_rank} {b!r}",
                                      reason="invalid_header")
    # Each tensor covered exactly once by the ranks' parts (as a push's shards).
    merge_shards(where, {rank: tuple(TensorSpec(t.name, t.shape, t.dtype, t.part) for t in p.tensors)
                         for rank, p in ranks.items()})
    aliases = dict(ranks[first_rank].aliases)
    p0 = ranks[first_rank]
    check_served(p0.model, p0.step, {name: (t.shape, t.dtype) for name, t in first.items()}, aliases, spec)
    placed, data_bytes = layout([(t.name, t.shape, t.dtype) for t in first.values()])
    if data_bytes > max_bytes:
        raise ResourceExhausted(f"{where}: {data_bytes} bytes, more than the {max_bytes} a version may have "
                                "(--max-version-bytes)", reason="too_large")
    parts: dict[str, list[tuple[int, PublishedTensor]]] = {name: [] for name in first}
    for rank, p in ranks.items():
        for t in p.tensors:
            parts[t.name].append((rank, t))
    for held in parts.values():
        held.sort(key=lambda rt: rt[1].elements[0])
    return CopyPlan({s.name: s for s in placed}, data_bytes, parts)


def check_served(model: str, step: int, tensors: Mapping[str, tuple[tuple[int, ...], str]], aliases: Mapping[str, str],
                 spec: rounding.ExportSpec) -> None:
    """INVALID_ARGUMENT unless `tensors` (served name -> shape, dtype) are exactly what `spec` serves of
    their masters (`rounding.served_tensors`): each master read back from its served names
    (`served_masters`), its shape from its elements (`master_shape`), and its served tensors compared."""
    where = subject(model, step=step)
    for alias, target in aliases.items():
        if target not in tensors or alias in tensors:
            raise InvalidArgument(f"{where}: alias {alias!r} must name a published tensor ({target!r}) and not be "
                                  "one", reason="invalid_header")
    tied: dict[str, tuple[str, ...]] = {}
    for alias, target in aliases.items():
        tied[target] = (*tied.get(target, ()), alias)
    names = list(tensors)
    for master, served in rounding.served_masters(names).items():
        elements = served[0]
        _, role = rounding.master_of(elements, names)
        shape = rounding.master_shape(role, tensors[elements][0])
        try:
            fmt = spec.format_for(master, shape, tied.get(master, ()))
            expected = [(n, tuple(s), d) for n, s, d in rounding.served_tensors(master, shape, fmt, spec.scaling)]
        except (ValueError, IndexError) as e:  # (a shape no format serves: a 1-D "packed" tensor)
            raise InvalidArgument(f"{subject(model, step=step, tensor=master)}: {e}", reason="invalid_header") from None
        got = [(n, tuple(tensors[n][0]), tensors[n][1]) for n in served]
        if got != expected:
            raise InvalidArgument(
                f"{subject(model, step=step, tensor=master)}: {spec.format} serves this master of shape "
                f"{list(shape)} as "
                f"{_listed(expected)}; the publish has {_listed(got)}", reason="invalid_header")


def _listed(tensors: list[tuple[str, tuple[int, ...], str]]) -> str:
    return ", ".join(f"{n!r} ({d} {list(s)})" for n, s, d in tensors)
