"""The package import graph: the dependency rules of docs/ARCHITECTURE.md, and no import cycles.

The graph is read from the source (every ``import`` statement, including the ones inside
functions: a lazy import is still a dependency, it only hides a cycle until run time).
"""
from __future__ import annotations

import ast
import subprocess
import sys
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
NARROW = {
    "router": {"common", "common.envs", "common.auth"},
    "bootstrap_server": {"common", "common.envs", "common.auth"},
}


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


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, node):
                    ours = _ours(target)
                    if ours is not None and ours != module:
                        graph[module].add(ours)
    return graph


def test_packages_import_only_what_the_architecture_allows() -> None:
    bad = []
    for module, deps in import_graph().items():
        pkg = module.split(".")[0]
        for dep in deps:
            dep_pkg = dep.split(".")[0]
            if dep_pkg != pkg and (dep_pkg not in ALLOWED[pkg] or (pkg in NARROW and dep_pkg == "common"
                                                                  and dep not in NARROW[pkg])):
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports that break docs/ARCHITECTURE.md's rules:\n" + "\n".join(sorted(bad))


def test_the_graph_sees_lazy_and_relative_imports() -> None:
    """The reader itself: a function-level import counts, and so does a `from pkg import module`."""
    graph = import_graph()
    assert "common.tools.make_tiny_model" in graph["common.tools.bench"]  # imported inside a function
    assert "common.auth" in graph["router.auth"]


@pytest.mark.parametrize("entry", ["router.app", "bootstrap_server.server"])
def test_light_processes_do_not_load_torch(entry: str) -> None:
    code = f"import sys, {entry}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {entry} loads torch"
