"""The package import graph: the dependency rules of docs/ARCHITECTURE.md, and no import cycles.

The graph is read from the source (every ``import`` statement, including the ones inside
functions and under ``if TYPE_CHECKING:``: a lazy import is still a dependency, it only hides a
cycle until run time).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "transfer", "bootstrap_server", "prefill_node", "decode_node", "router")

# What each package may import of ours (docs/ARCHITECTURE.md, "Packages").
ALLOWED = {
    "common": set(),
    "bootstrap_server": {"common"},
    "transfer": {"common", "bootstrap_server"},
    "prefill_node": {"common", "transfer", "bootstrap_server"},
    "decode_node": {"common", "transfer", "bootstrap_server"},
    "router": {"common"},
}
# The router and the registry are light processes: of common they use only these (no torch).
# common.pd_contract is the router <-> node contract (stdlib only), shared rather than copied;
# common.kv_events the KV events' format and block hashes (msgspec), common.frame_auth their seal.
NARROW = {
    "router": {"common", "common.envs", "common.auth", "common.http_limits", "common.aio_body", "common.pd_contract",
               "common.kv_events", "common.frame_auth"},
    "bootstrap_server": {"common", "common.envs", "common.auth", "common.http_limits", "common.aio_body"},
}
# The command-line tools in common/tools/ are programs on top of the packages, not part of one:
# they may import what the transfer layer's users may (the transfer benchmark drives the KV
# managers and a bootstrap server itself). No package module imports a tool (tested below), so
# the rules above still hold for everything a node, the router or the registry loads.
TOOLS = "common.tools"
TOOLS_ALLOWED = {"common", "transfer", "bootstrap_server"}

# Import cycles allowed, and no others: none. (Issue 12's room table removed the last four, in
# transfer/: the KV managers and the room pieces they hand out typing each other.) Should one ever
# have to be allowed, it goes here, one entry per cycle, written from its module first in sort
# order; an entry that no longer occurs fails the test too, so this list only shrinks.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    if node.level:
        base = module.split(".")
        if not MODULES[module].name == "__init__.py":
            base.pop()
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    for alias in node.names:  # `from pkg import submodule` depends on the submodule
        yield f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target


def _ours(name: str) -> str | None:
    """The module of ours ``name`` resolves to (the longest known prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_lines() -> dict[tuple[str, str], int]:
    """(importer, imported module) -> the line of the importer's first import of it."""
    lines: dict[tuple[str, str], int] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, node):
                    ours = _ours(target)
                    if ours is not None and ours != module:
                        edge = (module, ours)
                        lines[edge] = min(lines.get(edge, node.lineno), node.lineno)
    return lines


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, dep in import_lines():
        graph[module].add(dep)
    return graph


def _is_tool(module: str) -> bool:
    return module == TOOLS or module.startswith(TOOLS + ".")


def test_packages_import_only_what_the_architecture_allows() -> None:
    bad = []
    for module, deps in import_graph().items():
        pkg = module.split(".")[0]
        allowed = TOOLS_ALLOWED if _is_tool(module) else ALLOWED[pkg]
        for dep in deps:
            dep_pkg = dep.split(".")[0]
            if dep_pkg != pkg and (dep_pkg not in allowed or (pkg in NARROW and dep_pkg == "common"
                                                              and dep not in NARROW[pkg])):
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports that break docs/ARCHITECTURE.md's rules:\n" + "\n".join(sorted(bad))


def test_no_package_module_imports_a_tool() -> None:
    """The tools' wider allowance must not leak into a package (``common.cli`` names its
    subcommands' modules as strings and imports only the one it runs)."""
    bad = [f"{m} -> {d}" for m, deps in import_graph().items() for d in deps if _is_tool(d) and not _is_tool(m)]
    assert not bad, "package modules that import a command-line tool:\n" + "\n".join(sorted(bad))


def test_common_holds_only_what_is_shared() -> None:
    """docs/ARCHITECTURE.md: common/ holds what both roles (or the router, the registry, the
    transfer layer, common itself) use. A module of common that only one role imports belongs to
    that role (as the prefill adder and the decode budget did)."""
    importers: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        for dep in deps:
            importers.setdefault(dep, set()).add(module.split(".")[0])
    one_role = sorted(m for m, pkgs in importers.items()
                      if m.startswith("common.") and len(pkgs) == 1 and pkgs <= {"prefill_node", "decode_node"})
    assert not one_role, "modules of common/ that only one role imports (move them to it): " + ", ".join(one_role)


def test_the_graph_sees_lazy_and_relative_imports() -> None:
    """The reader itself: a function-level import counts, and so does a `from pkg import module`."""
    graph = import_graph()
    assert "common.tools.make_tiny_model" in graph["common.tools.bench"]  # imported inside a function
    assert "common.auth" in graph["router.auth"]


# ---- cycles ------------------------------------------------------------------------------------


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: each module of one reaches
    every other one through imports (no module imports itself in ``import_graph``)."""
    reach = {m: _reachable(graph, m) for m in graph}
    out: list[set[str]] = []
    for m in sorted(graph):
        if m in reach[m] and not any(m in t for t in out):
            out.append({n for n in reach[m] if m in reach[n]})
    return out


def _rotated(cycle: list[str]) -> tuple[str, ...]:
    i = cycle.index(min(cycle))
    return tuple(cycle[i:] + cycle[:i])


def _shortest_cycle(graph: dict[str, set[str]], start: str, within: set[str]) -> tuple[str, ...]:
    """A shortest cycle through ``start`` (breadth first), written from its first module in sort order."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        m = queue.popleft()
        for dep in sorted(graph[m] & within):
            if dep == start:
                chain = [m]
                while (up := parent[chain[-1]]) is not None:
                    chain.append(up)
                return _rotated(chain[::-1])
            if dep not in parent:
                parent[dep] = m
                queue.append(dep)
    raise AssertionError(f"{start} is on no cycle")


def _every_cycle(graph: dict[str, set[str]], comp: set[str]) -> set[tuple[str, ...]]:
    """Every elementary cycle of a component, each from its first module in sort order (exponential:
    for the few modules of the known cycles only)."""
    found: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for dep in graph[path[-1]] & comp:
            if dep == path[0]:
                found.add(tuple(path))
            elif dep > path[0] and dep not in path:
                walk(path + [dep])

    for start in comp:
        walk([start])
    return found


def import_cycles(graph: dict[str, set[str]], known: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """The known cycles that still occur, plus for each tangle that reaches beyond the known
    cycles' modules one shortest cycle through a module outside them (so it is a new one)."""
    known_modules = {m for cycle in known for m in cycle}
    found: set[tuple[str, ...]] = set()
    for comp in tangles(graph):
        outside = sorted(comp - known_modules)
        if outside:
            found.add(_shortest_cycle(graph, outside[0], comp))
        else:
            found |= _every_cycle(graph, comp)
    return found


def _chain(cycle: tuple[str, ...], lines: dict[tuple[str, str], int]) -> str:
    """``a -> b -> a``, then where each import is."""
    hops = list(zip(cycle, cycle[1:] + cycle[:1]))
    where = [f"      {MODULES[a].relative_to(REPO)}:{lines[a, b]} imports {b}" for a, b in hops]
    return "  " + " -> ".join([*cycle, cycle[0]]) + "\n" + "\n".join(where)


def test_the_cycle_check_finds_and_spells_out_cycles() -> None:
    """The checker itself, on a hand-made graph: a known cycle passes, a new one is reported."""
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"b"}, "e": {"a"}}
    assert tangles(graph) == [{"a", "b", "c", "d"}]
    # "c" and "d" lie outside the known cycle: one cycle through "c" is reported.
    assert import_cycles(graph, {("a", "b")}) == {("b", "c", "d")}
    assert import_cycles(graph, {("a", "b"), ("b", "c", "d")}) == {("a", "b"), ("b", "c", "d")}
    assert import_cycles({"a": {"b"}, "b": set()}, set()) == set()


def test_no_import_cycles_but_the_known_ones() -> None:
    lines = import_lines()
    found = import_cycles(import_graph(), KNOWN_CYCLES)
    new = sorted(found - KNOWN_CYCLES)
    assert not new, "import cycles (break each: move what both sides need into a module below them):\n" + \
        "\n".join(_chain(c, lines) for c in new)
    gone = sorted(KNOWN_CYCLES - found)
    assert not gone, "KNOWN_CYCLES lists cycles that no longer occur; delete them:\n" + \
        "\n".join("  " + " -> ".join([*c, c[0]]) for c in gone)


@pytest.mark.parametrize("entry", ["router.app", "bootstrap_server.server"])
def test_light_processes_do_not_load_torch(entry: str) -> None:
    code = f"import sys, {entry}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {entry} loads torch"
