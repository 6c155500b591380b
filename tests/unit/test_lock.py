"""The dependency locks agree with pyproject.toml, and the venv the tests run in is the lock.

requirements/*.lock are written by ``make lock`` (scripts/lock.sh, ``uv pip compile``), which
annotates every pin with what asked for it (``# via ...``). The checks here need no network:

- every dependency pyproject.toml declares for a path (main + [cpu,test] for cpu.lock, main +
  [gpu] for gpu.lock) is pinned there, at a version its specifier accepts, and names pyproject
  as a reason;
- every pin is there for a reason that still holds: walking the ``via`` edges back from what
  pyproject.toml and the .in files ask for reaches it (a package dropped from pyproject.toml, or
  pasted into the lock by hand, fails);
- the packages of this interpreter are the lock's versions (``make setup`` installs nothing else).
"""
from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
PYPROJECT = "pdcluster (pyproject.toml)"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)$")


def parse_lock(path: Path) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, the reasons its ``# via`` annotation gives), names canonicalized."""
    pins: dict[str, tuple[str, set[str]]] = {}
    current: str | None = None
    for line in path.read_text().splitlines():
        if m := PIN.match(line):
            current = canonicalize_name(m.group(1))
            assert current not in pins, f"{path.name}: {current} pinned twice"
            pins[current] = (m.group(2), set())
        elif line.startswith("    # via") and current is not None:
            rest = line.removeprefix("    # via").strip()
            if rest:
                pins[current][1].add(rest)
        elif line.startswith("    #   ") and current is not None:
            pins[current][1].add(line.removeprefix("    #   ").strip())
        elif line.strip() and not line.startswith("#") and not line.startswith("--"):
            raise AssertionError(f"{path.name}: unexpected line {line!r} (not an exact pin)")
    return pins


def pyproject_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def in_file_names(path: Path) -> set[str]:
    return {canonicalize_name(Requirement(ln.split("#")[0].strip()).name)
            for ln in path.read_text().splitlines() if ln.split("#")[0].strip()}


def check_lock(lock: Path, extras: tuple[str, ...], in_files: tuple[Path, ...], drop: set[str] = frozenset(),  # type: ignore[assignment]
               constraints: tuple[Path, ...] = ()) -> None:
    pins = parse_lock(lock)
    declared = {canonicalize_name(r.name): r for r in pyproject_requirements(extras)}
    for name in drop:
        declared.pop(name, None)
    for name, req in declared.items():
        assert name in pins, f"{lock.name}: pyproject.toml needs {req} but the lock has no {name}: run `make lock`"
        version, via = pins[name]
        assert req.specifier.contains(version.split("+")[0], prereleases=True), \
            f"{lock.name}: {name}=={version} does not satisfy pyproject.toml's {req}: run `make lock`"
        assert PYPROJECT in via, f"{lock.name}: {name} is in pyproject.toml but the lock does not say so"
    # Roots: what pyproject.toml and the .in files ask for; everything else hangs off a pinned parent.
    roots = set(declared)
    reasons = ({PYPROJECT} | {f"-r requirements/{p.name}" for p in in_files}
               | {f"-c requirements/{p.name}" for p in constraints})
    for p in in_files:
        roots |= in_file_names(p)
    for name, (_, via) in pins.items():
        if PYPROJECT in via:
            assert name in declared, f"{lock.name}: {name} says pyproject.toml needs it, which it no longer does"
        unknown = {v for v in via if v not in reasons and canonicalize_name(v.split(" ")[0]) not in pins}
        assert not unknown, f"{lock.name}: {name} is there for {unknown}, which the lock does not hold"
    reached, frontier = set(), [n for n in pins if n in roots]
    children: dict[str, set[str]] = {}
    for name, (_, via) in pins.items():
        for v in via:
            children.setdefault(canonicalize_name(v.split(" ")[0]), set()).add(name)
    while frontier:
        n = frontier.pop()
        if n not in reached:
            reached.add(n)
            frontier += children.get(n, set())
    orphans = set(pins) - reached
    assert not orphans, f"{lock.name}: pinned for no reason that still holds: {sorted(orphans)}; run `make lock`"


def test_cpu_lock_matches_pyproject() -> None:
    check_lock(REQ / "cpu.lock", ("cpu", "test"), (REQ / "cpu.in",))
    version, _ = parse_lock(REQ / "cpu.lock")["torch"]
    assert version.endswith("+cpu"), f"the CPU path must pin the CPU build of torch, not {version}"


def test_gpu_lock_matches_pyproject_without_torch() -> None:
    check_lock(REQ / "gpu.lock", ("gpu",), (), drop={"torch"})
    pins = parse_lock(REQ / "gpu.lock")
    assert "torch" not in pins and not any(n.startswith("nvidia-cuda-runtime") for n in pins), \
        "the GPU image keeps its base's CUDA torch: the lock must not bring its own"


def test_sglang_router_lock_pins_the_version_the_tests_measure() -> None:
    from tests.e2e.test_sglang_router import ROUTER_VERSION

    check_lock(REQ / "sglang-router.lock", (), (REQ / "sglang-router.in",), drop=set(
        canonicalize_name(r.name) for r in pyproject_requirements(())))
    assert parse_lock(REQ / "sglang-router.lock")["sglang-router"][0] == ROUTER_VERSION


def test_router_image_lock_holds_the_cpu_locks_versions() -> None:
    check_lock(REQ / "router.lock", (), (REQ / "router.in",), drop=set(
        canonicalize_name(r.name) for r in pyproject_requirements(())), constraints=(REQ / "cpu.lock",))
    cpu = parse_lock(REQ / "cpu.lock")
    for name, (version, _) in parse_lock(REQ / "router.lock").items():
        assert cpu[name][0] == version, f"router.lock pins {name}=={version}, cpu.lock {cpu[name][0]}"


def test_check_lock_catches_a_dependency_on_one_side_only(tmp_path: Path) -> None:
    lock = (REQ / "cpu.lock").read_text()
    # pasted into the lock by hand, needed by nothing
    (tmp_path / "extra.lock").write_text(lock + "leftpad==1.0\n    # via pdcluster (pyproject.toml)\n")
    with pytest.raises(AssertionError, match="leftpad"):
        check_lock(tmp_path / "extra.lock", ("cpu", "test"), (REQ / "cpu.in",))
    # declared in pyproject.toml, missing from the lock
    (tmp_path / "short.lock").write_text(re.sub(r"(?ms)^msgspec==.*?(?=^\S)", "", lock))
    with pytest.raises(AssertionError, match="msgspec"):
        check_lock(tmp_path / "short.lock", ("cpu", "test"), (REQ / "cpu.in",))


def test_this_venv_is_the_cpu_lock() -> None:
    """``make setup`` installs the lock and nothing else resolved on the side: every locked
    package is installed at the locked version."""
    wrong = {}
    for name, (version, _) in parse_lock(REQ / "cpu.lock").items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != version:
            wrong[name] = (version, have)
    assert not wrong, f"installed versions differ from requirements/cpu.lock (locked, installed): {wrong}; run `make setup`"
