"""The package's shape, measured from its own code: no import cycles, imports down the floors, one home each.

Every import counts, the ones inside functions too: a lazy import still ties the two modules, it only
hides the tie from the interpreter until it runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "weightsvc"
GENERATED = PACKAGE / "v1"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if GENERATED in path.parents:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports (a package's __init__ counts only when it is named)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # `from pkg import mod` names the submodule; `from mod import name` the module.
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle() -> None:
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    # A package's __init__ that re-exports its modules is not a cycle with them.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_two_classes_share_a_name() -> None:
    """A class name says which class it is: a reader (and a traceback) never has to ask which of two."""
    where: dict[str, list[str]] = {}
    for name, path in sorted(modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    assert {c: found for c, found in where.items() if len(found) > 1} == {}


def test_messages_name_their_subject_one_way() -> None:
    """Model, version or step, and tensor are named by `errors.subject`, never written out by hand."""
    by_hand = re.compile(r"model \{[^{}]*!r\} (version|step) \{")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in modules().values()
             for n, line in enumerate(path.read_text().splitlines(), 1) if by_hand.search(line)]
    assert found == []


# What each room of the package may import besides itself (the floors below it). `cli` is the top
# floor and takes anything.
FLOOR = {"errors", "_log", "_faults", "_aio", "_small_http", "v1"}
MAY_IMPORT = {
    "errors": set(),
    "_log": set(),
    "_faults": set(),
    "_small_http": set(),
    "_aio": set(),  # keeping the event loop free is no rule of any room: every room that runs on it may use it
    "v1": set(),
    "memory": FLOOR,
    "rounding": FLOOR,
    "settings": FLOOR | {"memory", "rounding"},
    "protocol": FLOOR | {"memory", "rounding"},
    "metrics": FLOOR | {"protocol"},
    "store": FLOOR | {"memory", "protocol"},
    "service": FLOOR | {"memory", "rounding", "protocol", "settings", "metrics", "store"},
    "transport": FLOOR | {"memory", "rounding", "protocol", "settings", "metrics", "service"},
    "client": FLOOR | {"memory", "rounding", "protocol", "store"},
    "integrations": FLOOR | {"memory", "rounding", "protocol", "client"},
    "loaders": {"integrations"},
    "server": FLOOR | {"memory", "rounding", "protocol", "settings", "metrics", "service", "transport", "client",
               "store"},
}


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_imports_run_down_the_floors() -> None:
    mods = modules()
    upward = []
    for name, path in sorted(mods.items()):
        own = room(name)
        if own not in MAY_IMPORT:
            continue
        for target in sorted(imports(name, path, set(mods))):
            other = room(target)
            if other and other != own and other not in MAY_IMPORT[own]:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_replicas_never_import_versions() -> None:
    """`service.replicas` (the registry, a replica's parts, the commit rule) is the floor below
    `service.versions` (the index, commit, restore, following other replicas' commits): versions read
    replicas, never the reverse. What both read (the version record) lies in `service.record`."""
    mods = modules()
    upward = [f"{name} -> {target}" for name, path in sorted(mods.items())
              if name.startswith("weightsvc.service.replicas.")
              for target in sorted(imports(name, path, set(mods)))
              if target.startswith("weightsvc.service.versions")]
    assert upward == []


# The rooms whose modules call the service from outside it, and the only modules of it they may name:
# the façade and its requests and answers. A part below them (pushes, pulls, versions, replicas) can
# change without a transport knowing.
OUTSIDE_THE_FACADE = ("transport", "server")
FACADE = {"weightsvc.service.service", "weightsvc.service.api"}


def test_transports_import_only_the_facade() -> None:
    mods = modules()
    past = []
    for name, path in sorted(mods.items()):
        if room(name) not in OUTSIDE_THE_FACADE:
            continue
        for target in sorted(imports(name, path, set(mods))):
            if room(target) == "service" and target not in FACADE:
                past.append(f"{name} -> {target}")
    assert past == []
