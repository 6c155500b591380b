"""deploy/docker and docs/OPERATIONS.md agree with the code (no Docker engine needed).

- Dockerfiles install their lock (requirements/*.lock, --no-deps), the CPU torch build among the
  CPU one's, the extras of pyproject.toml, and every package the wheel needs; our router's image
  has no torch; the sglang-router alternative names the version its lock pins.
- docs/OPERATIONS.md tables match common/envs.py and the launchers' flags.
"""
from __future__ import annotations

import re
import tomllib

import pytest

from common import envs
from tests.unit.test_deploy_manifests import DOCKER, K8S, OPERATIONS, ROOT, _containers, _load, _role_parser

# -- Dockerfiles ---------------------------------------------------------------------------------


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _copied(dockerfile: str) -> set[str]:
    return {src.rstrip("/") for line in dockerfile.splitlines() if line.startswith("COPY ")
            for src in line.split()[1:-1] if not src.startswith("--")}


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_dockerfile_builds_the_whole_wheel_as_a_non_root_pdcluster_entrypoint(flavour: str) -> None:
    text = (DOCKER / f"Dockerfile.{flavour}").read_text()
    project = _pyproject()
    assert flavour in project["project"]["optional-dependencies"]
    assert re.search(rf"pip install --no-deps (--no-build-isolation )?'\.\[{flavour}\]'", text)
    # pip builds the wheel from /src: the readme and every package it lists must be copied in.
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = {"pyproject.toml", project["project"]["readme"], *packages}
    assert needed <= _copied(text), f"Dockerfile.{flavour} does not copy {needed - _copied(text)}"
    ignore = [ln.strip() for ln in (DOCKER / f"Dockerfile.{flavour}.dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", "the ignore file must exclude everything, then re-include what is copied"
    assert all(f"!{n}" in ignore or f"!{n}/" in ignore for n in needed | _copied(text)), \
        "the ignore file drops a copied path"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0") and users[-1].split(":")[0].isdigit()
    assert re.search(r'^ENTRYPOINT \["pdcluster"\]$', text, re.M)
    for lib in ("libibverbs1", "libnuma1"):
        assert lib in text


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_dockerfile_installs_its_lock_and_nothing_resolved_on_the_side(flavour: str) -> None:
    text = (DOCKER / f"Dockerfile.{flavour}").read_text()
    lock = f"requirements/{flavour}.lock"
    assert lock in _copied(text), f"Dockerfile.{flavour} does not copy {lock}"
    installs = [ln for ln in text.splitlines() if re.search(r"\bpip install\b", ln)]
    assert installs and all("--no-deps" in ln for ln in installs), f"every pip install must be --no-deps: {installs}"
    assert text.index(f"/tmp/{flavour}.lock") < text.index(f"'.[{flavour}]'"), "the lock goes in before the project"


def test_cpu_dockerfile_takes_the_cpu_torch_of_the_lock_and_mooncake_libraries() -> None:
    text = (DOCKER / "Dockerfile.cpu").read_text()
    assert re.search(r"^torch==[0-9.]+\+cpu$", (ROOT / "requirements" / "cpu.lock").read_text(), re.M)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu -r /tmp/cpu.lock" in text, \
        "torch +cpu is on PyTorch's CPU index, not PyPI"
    deps = (ROOT / "scripts" / "install_system_deps.sh").read_text()
    libs = set(re.search(r"apt-get install -y -qq ([^>]+)", deps).group(1).split())  # type: ignore[union-attr]
    assert libs and all(re.search(rf"\b{re.escape(lib)}\b", text) for lib in libs)
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)


def test_gpu_dockerfile_starts_from_a_cuda_pytorch_image() -> None:
    text = (DOCKER / "Dockerfile.gpu").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M)
    assert base and ("nvidia" in base.group(1) or "cuda" in base.group(1)) and "FROM ${BASE_IMAGE}" in text


def test_router_image_is_ours_without_torch_and_the_sglang_component_names_its_own() -> None:
    text = (DOCKER / "Dockerfile.router").read_text()
    assert re.search(r'^ENTRYPOINT \["pdcluster", "router"\]$', text, re.M)
    assert "pip install --no-deps -r /tmp/router.lock" in text and "requirements/router.lock" in _copied(text)
    assert all("--no-deps" in ln for ln in text.splitlines() if re.search(r"\bpip install\b", ln))
    images = {c["image"] for d in _load(K8S / "base" / "router.yaml") for c in _containers(d)}
    assert images == {"pdcluster-router"}
    sglang = (DOCKER / "Dockerfile.sglang-router").read_text()
    assert "-r /tmp/sglang-router.lock" in sglang
    (version,) = re.findall(r"^sglang-router==([0-9.]+)$", (ROOT / "requirements" / "sglang-router.lock").read_text(),
                            re.M)
    component = (K8S / "components" / "sglang-router" / "kustomization.yaml").read_text()
    assert f"pdcluster-router:sglang-router-{version}" in component


# -- docs/OPERATIONS.md --------------------------------------------------------------------------


def _section_table(heading: str) -> list[list[str]]:
    """Rows (cells stripped) of the first table after ``heading`` in OPERATIONS.md."""
    text = OPERATIONS.read_text()
    start = text.index(heading)
    rows: list[list[str]] = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # drop the header


def test_operations_env_table_matches_envs() -> None:
    rows = _section_table("### Environment variables")
    documented = {r[0].strip("`"): r[1].strip("`") for r in rows}
    code = {v.name: v for v in envs.all_vars()}
    assert set(documented) == set(code), f"missing {set(code) - set(documented)}, unknown {set(documented) - set(code)}"
    for name, default in documented.items():
        var = code[name]
        expected = "(empty)" if var.default == "" else str(var.default)
        assert default == expected, f"{name}: the doc says {default}, the code {expected}"


def test_operations_flag_table_matches_the_launchers() -> None:
    rows = _section_table("### Node flags")
    parsers = {role: _role_parser(role) for role in ("prefill", "decode")}
    flags = {role: {a.option_strings[0]: a for a in p._actions if a.option_strings and a.dest != "help"}
             for role, p in parsers.items()}
    documented: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for flag_cell, roles_cell, default_cell, *_ in rows:
        flag = flag_cell.strip("`").split()[0]
        roles = ("prefill", "decode") if roles_cell == "both" else (roles_cell,)
        for role in roles:
            assert flag in flags[role], f"OPERATIONS.md: pdcluster {role} has no {flag}"
            documented[role].add(flag)
            action = flags[role][flag]
            if action.required:
                expected = "required"
            elif action.default is None or action.default is False:
                expected = "—"
            else:
                expected = str(action.default)
            assert default_cell.strip("`") == expected, f"{flag} ({role}): doc {default_cell}, parser {expected}"
    for role in documented:
        missing = set(flags[role]) - documented[role]
        assert not missing, f"{role} flags not documented in OPERATIONS.md: {missing}"
