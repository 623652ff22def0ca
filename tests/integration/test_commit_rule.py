"""The commit rule is stated once in Python (`commit_rule`, `part_rule`) and again in the Lua that
Redis runs (`finish` and `_COMMIT_PART` in replicas/redis.py): each case of the table goes through
the Python rule and through the registries (the Lua on real Redis, and the embedded one), which
must decide alike: accepted, and each kind of refusal."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from dataclasses import dataclass, field

import pytest

from weightsvc.errors import AlreadyExists, DataLoss, FailedPrecondition
from weightsvc.service.replicas.registry import CommitResult, Registry, combined_digest, commit_rule, part_rule

RETAIN = 10
Groups = dict[str, str]  # a part's groups of tensors (by their owners) -> the digest of what each holds


@dataclass(frozen=True)
class Whole:
    """A version committed whole, with its master digest."""

    version: int
    digest: str


@dataclass(frozen=True)
class OfParts:
    """A version committed as the parts of its owners: each owner's part digest."""

    version: int
    digests: dict[str, str]


@dataclass(frozen=True)
class Part:
    """A part pushed by `owner`, of a version made of the parts of `owners`."""

    version: int
    owner: str
    digest: str
    owners: tuple[str, ...] = ("r0", "r1")
    groups: Groups = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    name: str
    held: tuple[Whole | OfParts, ...]  # what the registry holds of the model before
    attempt: Whole | Part
    expected: str  # the decision: created, exists, conflict, not_above, pending, diverged
    waiting: tuple[Part, ...] = ()  # other owners' parts recorded before, of the attempt's version


CASES = [
    Case("a model's first version", (), Whole(1, "a"), "created"),
    Case("a step above the latest", (Whole(1, "a"),), Whole(2, "b"), "created"),
    Case("the same step, the same content", (Whole(1, "a"),), Whole(1, "a"), "exists"),
    Case("the same step, other content", (Whole(1, "a"),), Whole(1, "b"), "conflict"),
    Case("a new step below the latest", (Whole(1, "a"), Whole(3, "c")), Whole(2, "b"), "not_above"),
    Case("an old step again, the same content", (Whole(1, "a"), Whole(3, "c")), Whole(1, "a"), "exists"),
    Case("an old step again, other content", (Whole(1, "a"), Whole(3, "c")), Whole(1, "x"), "conflict"),
    Case("a whole version where one of parts is", (OfParts(2, {"r0": "a", "r1": "b"}),), Whole(2, "a"),
         "conflict"),
    Case("a part, the other owner's missing", (), Part(1, "r0", "a"), "pending"),
    Case("a part, above the latest, waiting", (Whole(1, "a"),), Part(2, "r0", "a"), "pending"),
    Case("the last owner's part", (), Part(1, "r0", "a"), "created", waiting=(Part(1, "r1", "b"),)),
    Case("replicated parts that agree", (), Part(1, "r0", "a", groups={"r0,r1": "g"}), "created",
         waiting=(Part(1, "r1", "b", groups={"r0,r1": "g"}),)),
    Case("replicated parts that differ", (), Part(1, "r0", "a", groups={"r0,r1": "g"}), "diverged",
         waiting=(Part(1, "r1", "b", groups={"r0,r1": "h"}),)),
    Case("a part already committed, the same content", (OfParts(1, {"r0": "a", "r1": "b"}),), Part(1, "r0", "a"),
         "exists"),
    Case("a part already committed, other content", (OfParts(1, {"r0": "a", "r1": "b"}),), Part(1, "r0", "z"),
         "conflict"),
    Case("a part of a version others committed", (OfParts(1, {"r0": "a", "r1": "b"}),),
         Part(1, "r2", "a", owners=("r0", "r2")), "conflict"),
    Case("a part where a whole version is", (Whole(1, "a"),), Part(1, "r0", "a"), "conflict"),
    Case("a part of a replica named as a manifest's field, where a whole version is", (Whole(1, "a"),),
         Part(1, "version", "a", owners=("r0", "version")), "conflict"),
    Case("a part below the latest", (Whole(3, "c"),), Part(2, "r0", "a"), "not_above"),
]


def held_digest(v: Whole | OfParts) -> str:
    """The digest the registry records with a held version."""
    if isinstance(v, Whole):
        return v.digest
    owners = sorted(v.digests)
    return combined_digest(owners, v.digests)


def python_rule(case: Case) -> tuple[str, str]:
    """What the Python rule decides, from the table alone."""
    held = {v.version: v for v in case.held}
    latest = max(held, default=None)
    a = case.attempt
    existing = held.get(a.version)
    if isinstance(a, Whole):
        return commit_rule(a.version, a.digest, None if existing is None else held_digest(existing), latest), ""
    parts = None if existing is None else existing.digests if isinstance(existing, OfParts) else {}
    pending = {p.owner: p.groups for p in (*case.waiting, a)}
    return part_rule(a.version, a.owner, a.digest, parts, latest, a.owners, pending)


async def decided(call: Awaitable[CommitResult | None]) -> tuple[str, str]:
    """What a registry decided, in the rule's words (with the group it names, when they diverged)."""
    try:
        result = await call
    except AlreadyExists:
        return "conflict", ""
    except FailedPrecondition:
        return "not_above", ""
    except DataLoss as e:
        owners = str(e).split("the owners ", 1)[1].split(" of a group", 1)[0]
        return "diverged", ",".join(json.loads(owners.replace("'", '"')))
    if result is None:
        return "pending", ""
    return ("created" if result.created else "exists"), ""


def manifest(model: str, version: int) -> str:
    return json.dumps({"model": model, "version": version})


async def pushed(registry: Registry, model: str, p: Part) -> CommitResult | None:
    return await registry.commit_part(model, p.version, p.owner, p.owners, p.digest, manifest(model, p.version),
                                      RETAIN, p.groups)


def test_the_table_holds_each_decision() -> None:
    assert {c.expected for c in CASES} == {"created", "exists", "conflict", "not_above", "pending", "diverged"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_the_registry_decides_as_the_python_rule(registry: Registry, case: Case) -> None:
    model = "m"
    for v in case.held:
        if isinstance(v, Whole):
            assert (await registry.commit(model, v.version, v.digest, manifest(model, v.version), RETAIN)).created
            continue
        owners = tuple(sorted(v.digests))
        results = [await pushed(registry, model, Part(v.version, o, d, owners)) for o, d in v.digests.items()]
        assert results[-1] is not None and results[-1].created
    for p in case.waiting:
        assert await pushed(registry, model, p) is None
    a = case.attempt
    if isinstance(a, Whole):
        got = await decided(registry.commit(model, a.version, a.digest, manifest(model, a.version), RETAIN))
    else:
        got = await decided(pushed(registry, model, a))
    rule = python_rule(case)
    assert rule[0] == case.expected
    assert got == rule
