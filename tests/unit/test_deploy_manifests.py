"""deploy/ agrees with the code it launches (no cluster, no Docker engine needed).

- Every YAML file under deploy/k8s parses, every kustomization names files that exist, and
  every YAML file is used by some kustomization.
- Every container that runs ``pdcluster prefill|decode`` passes its args through that role's real
  ``build_parser()`` (an unknown flag or a bad value fails here, not in a crash-looping pod), and
  the config pieces built from them validate. ``make-tiny-model`` containers run for real.
- Each overlay, rendered with ``kubectl kustomize`` when kubectl is on PATH: ``$(VAR)`` args
  resolved from the rendered ConfigMaps as the kubelet does, probes on routes the shared API app
  serves and on the port the node listens on, prefill/decode settings that the KV layout check
  requires to be equal, and a router that lists every prefill/decode pod by a name the headless
  Services give it, with the prefill's bootstrap port.
- Access control: every pdcluster container (and sglang-router) reads the cluster secret from the
  rendered Secret, our router its API key; the NetworkPolicy admits to the nodes only the router
  (on the HTTP ports) and the other node pods, nothing from outside.
- Dockerfiles and docs/OPERATIONS.md: tests/unit/test_deploy_images_and_docs.py.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest

from common import envs
from common.cli import COMMANDS
from common.node.launch import (
    STARTUP_TIMEOUT_S,
    STOP_GRACE_S,
    attention_config,
    cache_config,
    server_config,
    transfer_config,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKER = DEPLOY / "docker"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KUBECTL = shutil.which("kubectl")
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# Base ConfigMap values that deliberately differ from the code's defaults (see base/kustomization.yaml).
BASE_ENV_EXCEPTIONS = {"PDC_MOONCAKE_PROTOCOL"}
# The sglang-router flags the manifests may use, as `python -m sglang_router.launch_router --help`
# of 0.3.2 (the version docs/PROTOCOL.md §1 describes) lists them; used when sglang_router is not installed.
ROUTER_FLAGS_032 = {
    "--pd-disaggregation": 0, "--prefill": "+", "--decode": 1, "--host": 1, "--port": 1,
    "--policy": 1, "--prefill-policy": 1, "--decode-policy": 1, "--worker-startup-timeout-secs": 1,
    "--prometheus-host": 1, "--prometheus-port": 1, "--health-check-interval-secs": 1,
    "--health-failure-threshold": 1, "--request-timeout-secs": 1, "--log-level": 1, "--api-key": 1,
}


def _yaml() -> Any:
    return pytest.importorskip("yaml", reason="PyYAML is not installed; the manifests cannot be parsed")


def _yaml_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def _load(path: Path) -> list[dict]:
    return [d for d in _yaml().safe_load_all(path.read_text()) if d is not None]


def _containers(doc: Any) -> Iterator[dict]:
    """Every container and initContainer anywhere in a document (pod templates, patches)."""
    if isinstance(doc, dict):
        for key in ("containers", "initContainers"):
            if isinstance(doc.get(key), list):
                yield from (c for c in doc[key] if isinstance(c, dict))
        for value in doc.values():
            yield from _containers(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from _containers(value)


def _pdcluster_argv(c: dict) -> list[str] | None:
    """The pdcluster argv (subcommand first) of a container, or None if it runs something else."""
    command = [str(x) for x in c.get("command") or []]
    args = [str(x) for x in c.get("args") or []]
    if command[:1] == ["pdcluster"]:
        return command[1:] + args
    if not command and str(c.get("image", "")).split(":")[0].endswith("pdcluster"):
        return args  # the image's ENTRYPOINT is ["pdcluster"]
    return None


def _base_env() -> dict[str, str]:
    """The literals of the base's ``pdcluster-env`` ConfigMap, which every node container reads."""
    kust = _yaml().safe_load((K8S / "base" / "kustomization.yaml").read_text())
    [gen] = [g for g in kust["configMapGenerator"] if g["name"] == "pdcluster-env"]
    return dict(lit.split("=", 1) for lit in gen["literals"])


def _resolve(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion: defined variables are replaced, others left as written."""
    return [ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def _role_parser(role: str) -> argparse.ArgumentParser:
    if role == "prefill":
        from prefill_node.__main__ import build_parser
    else:
        from decode_node.__main__ import build_parser
    return build_parser()


def _parse_node(role: str, argv: list[str]) -> argparse.Namespace:
    try:
        ns = _role_parser(role).parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"pdcluster {role} rejects the manifest's args {argv}") from exc
    # What the launcher builds from the flags, minus the parts that need the model on disk.
    cache_config(ns, enable_prefix_cache=True).validate()
    # The pod reads its secret from the pdcluster-auth Secret, which an overlay fills with a real
    # value (the base's placeholders are refused: test_deploy_access.py); stand one in here.
    with mock.patch.dict(os.environ, {"PDC_CLUSTER_SECRET": "an-overlay-secret-0123456789abcdef"}):
        transfer_config(ns).validate()
    server_config(ns).validate()
    attention_config(ns).validate()
    return ns


def _check_tiny_model(argv: list[str], tmp_path: Path) -> None:
    from common.tools.make_tiny_model import main as make_tiny_model

    assert argv[-1] == "$(MODEL_PATH)", f"make-tiny-model must write where the nodes read, got {argv[-1]!r}"
    out = tmp_path / "model"
    assert make_tiny_model([*argv[:-1], str(out)]) == 0
    assert (out / "config.json").is_file()


# -- files and kustomizations ------------------------------------------------------------------


def test_every_yaml_file_parses_to_objects() -> None:
    files = _yaml_files()
    assert len(files) >= 6, files
    for path in files:
        docs = _load(path)
        assert docs, f"{path} is empty"
        for doc in docs:
            assert isinstance(doc, dict) and "kind" in doc and "apiVersion" in doc, f"{path}: {doc!r:.80}"


def _kustomization_refs(kdir: Path) -> list[Path]:
    (k,) = _load(kdir / "kustomization.yaml")
    refs: list[Path] = []
    for entry in k.get("resources", []) + k.get("components", []):
        path = (kdir / entry).resolve()
        assert path.exists(), f"{kdir}/kustomization.yaml: resource {entry} does not exist"
        if path.is_dir():
            assert (path / "kustomization.yaml").is_file(), f"{path} has no kustomization.yaml"
        refs.append(path)
    for patch in k.get("patches", []):
        assert "path" in patch or "patch" in patch, f"{kdir}: a patch with neither path nor patch"
        if "path" in patch:
            refs.append((kdir / patch["path"]).resolve())
            assert refs[-1].is_file(), f"{kdir}: patch file {patch['path']} does not exist"
        else:
            _yaml().safe_load(patch["patch"])  # inline patches must parse too
    for gen in k.get("configMapGenerator", []):
        for f in gen.get("files", []) + gen.get("envs", []):
            refs.append((kdir / f.split("=")[-1]).resolve())
            assert refs[-1].is_file(), f"{kdir}: generator file {f} does not exist"
    return refs


def test_kustomizations_name_existing_files_and_no_yaml_is_orphaned() -> None:
    kdirs = sorted({p.parent for p in K8S.rglob("kustomization.yaml")})
    assert K8S / "base" in kdirs and {"cpu-tiny", "gpu"} <= {p.name for p in OVERLAYS}
    used = {d / "kustomization.yaml" for d in kdirs}
    for kdir in kdirs:
        used.update(p for p in _kustomization_refs(kdir) if p.is_file())
    orphans = [p for p in _yaml_files() if p.resolve() not in used]
    assert not orphans, f"YAML files no kustomization uses: {orphans}"


def test_every_pdcluster_container_in_every_file_has_valid_args(tmp_path: Path) -> None:
    """Raw files (no rendering): flags must be literal enough for the real parsers."""
    seen: set[str] = set()
    for path in _yaml_files():
        for doc in _load(path):
            for c in _containers(doc):
                argv = _pdcluster_argv(c)
                if argv is None:
                    continue
                env = {e["name"]: str(e.get("value", "")) for e in c.get("env", [])}
                argv = _resolve(argv, env)
                assert argv and argv[0] in COMMANDS, f"{path}: {c.get('name')} runs unknown subcommand {argv[:1]}"
                seen.add(argv[0])
                if argv[0] in ("prefill", "decode"):
                    # Numbers from the base's pdcluster-env ConfigMap (envFrom), e.g. --tp-size.
                    _parse_node(argv[0], _resolve(argv[1:], _base_env()))
                elif argv[0] == "router":
                    _parse_our_router(argv[1:])
                elif argv[0] == "make-tiny-model":
                    _check_tiny_model(argv[1:], tmp_path)
    assert {"prefill", "decode", "router", "make-tiny-model"} <= seen


# -- rendered overlays ------------------------------------------------------------------------------


class Rendered:
    """One overlay as ``kubectl kustomize`` renders it."""

    def __init__(self, docs: list[dict]) -> None:
        self.docs = docs
        self.by_kind: dict[str, dict[str, dict]] = {}
        for d in docs:
            self.by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d

    def env_of(self, c: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in c.get("envFrom", []):
            name = src["configMapRef"]["name"]
            assert name in self.by_kind.get("ConfigMap", {}), f"container {c['name']} reads missing ConfigMap {name}"
            env.update({k: str(v) for k, v in self.by_kind["ConfigMap"][name].get("data", {}).items()})
        for e in c.get("env", []):
            env[e["name"]] = str(e.get("value", ""))
        return env

    def nodes(self) -> dict[str, tuple[dict, dict, argparse.Namespace, dict[str, str]]]:
        """role -> (StatefulSet, container, parsed args, env) for the prefill and decode sets."""
        out = {}
        for sts in self.by_kind.get("StatefulSet", {}).values():
            for c in sts["spec"]["template"]["spec"]["containers"]:
                argv = _pdcluster_argv(c)
                if argv and argv[0] in ("prefill", "decode"):
                    env = self.env_of(c)
                    assert argv[0] not in out, f"two {argv[0]} StatefulSets: route them with separate router lists"
                    out[argv[0]] = (sts, c, _parse_node(argv[0], _resolve(argv[1:], env)), env)
        assert set(out) == {"prefill", "decode"}, f"StatefulSets found for {sorted(out)}"
        return out


_RENDERED: dict[Path, Rendered] = {}


def _render(kdir: Path) -> Rendered:
    if KUBECTL is None:
        pytest.skip("kubectl is not on PATH: overlays are checked file by file only")
    if kdir not in _RENDERED:
        proc = subprocess.run([KUBECTL, "kustomize", str(kdir)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"kubectl kustomize {kdir} failed:\n{proc.stderr}"
        _RENDERED[kdir] = Rendered([d for d in _yaml().safe_load_all(proc.stdout) if d])
    return _RENDERED[kdir]


def _app_get_routes() -> set[str]:
    from common.server.app import create_app
    from common.server.config import ApiConfig
    from common.ipc.scheduler_client import SchedulerClient

    # Building the app binds nothing: sockets open in its lifespan, which never runs here.
    client = SchedulerClient("ipc:///nonexistent-to", "ipc:///nonexistent-from")
    cfg = ApiConfig(role="decode", model_path="/m", context_length=16)
    app = create_app(cfg, client, None)  # type: ignore[arg-type]  # no tokenizer: nothing is served
    return {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}


def test_base_renders() -> None:
    assert set(_render(K8S / "base").by_kind["StatefulSet"]) == {"prefill", "decode"}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_nodes_probes_and_env(overlay: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = _render(overlay)
    routes = _app_get_routes()
    known_env = {v.name: v for v in envs.all_vars()}
    for role, (sts, c, ns, env) in r.nodes().items():
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == ns.port, f"{role}: container port http != --port {ns.port}"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]["httpGet"]
            assert probe["path"] in routes, f"{role} {kind} path {probe['path']} is not an API route"
            assert ports.get(probe["port"], probe["port"]) == ns.port, f"{role} {kind} probes another port"
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= STARTUP_TIMEOUT_S, \
            f"{role}: the startup probe gives up before the launcher's own {STARTUP_TIMEOUT_S:g} s start-up limit"
        assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= STOP_GRACE_S + 10, \
            f"{role}: uvicorn drains for 5 s, then the scheduler has STOP_GRACE_S before SIGKILL"
        assert ns.host == "0.0.0.0", f"{role}: peers reach a pod on its IP; --host must not be loopback"
        assert ns.model_path.startswith("/models/"), f"{role}: model {ns.model_path} is outside the models volume"
        # Every PDC_* variable is one pdcluster reads, with a value its type accepts.
        for name, value in env.items():
            if name.startswith("PDC_"):
                assert name in known_env, f"{overlay.name}: {name} is not in common/envs.py"
                monkeypatch.setenv(name, value)
                known_env[name].get()
        # Volumes: every mount has a volume; every claim is rendered alongside.
        pod = sts["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for cont in pod["containers"] + pod.get("initContainers", []):
            for m in cont.get("volumeMounts", []):
                assert m["name"] in volumes, f"{role}: mount {m['name']} has no volume"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in r.by_kind.get("PersistentVolumeClaim", {})


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_prefill_and_decode_can_exchange_kv(overlay: Path) -> None:
    """What bootstrap_server.schema.check_receivable compares must be equal on both sides."""
    nodes = _render(overlay).nodes()
    (_, _, p, penv), (_, _, d, denv) = nodes["prefill"], nodes["decode"]
    for field in ("page_size", "dtype", "disaggregation_transfer_backend", "model_path", "served_model_name"):
        assert getattr(p, field) == getattr(d, field), f"{overlay.name}: {field} differs"
    assert penv.get("PDC_MOONCAKE_PROTOCOL") == denv.get("PDC_MOONCAKE_PROTOCOL")


def _parse_our_router(argv: list[str]) -> tuple[list[tuple[str, int | None]], list[str]]:
    """(prefill (url, bootstrap port) list, decode url list) as our router's parser reads them."""
    from router.config import ConfigError, parse_config

    keys = {"PDC_API_KEY": "an-overlay-api-key-0123456789abcdef",
            "PDC_OPERATOR_KEY": "an-overlay-operator-key-0123456789abcdef"}  # from the Secret, in a pod
    try:
        with mock.patch.dict(os.environ, keys):
            cfg = parse_config(argv)
    except (SystemExit, ConfigError) as exc:
        raise AssertionError(f"pdcluster router rejects the manifest's args {argv}: {exc}") from exc
    return ([(w.url, w.bootstrap_port) for w in cfg.workers if w.role == "prefill"],
            [w.url for w in cfg.workers if w.role == "decode"])


def _router_routes() -> set[str]:
    from router.app import create_app
    from router.config import RouterConfig

    return {r.resource.canonical for r in create_app(RouterConfig()).router.routes() if r.method == "GET"}


def _router_workers(argv: list[str]) -> tuple[list[tuple[str, int | None]], list[str]]:
    """(prefill (url, bootstrap port) list, decode url list) as sglang-router parses them."""
    try:
        from sglang_router.launch_router import parse_router_args
    except ImportError:
        parser = argparse.ArgumentParser(prog="sglang-router-0.3.2", exit_on_error=False)
        for flag, nargs in ROUTER_FLAGS_032.items():
            if nargs == 0:
                parser.add_argument(flag, action="store_true")
            elif flag in ("--prefill", "--decode"):
                parser.add_argument(flag, nargs=nargs, action="append", default=[])
            else:
                parser.add_argument(flag)
        ns, unknown = parser.parse_known_args(argv)
        assert not unknown, f"flags sglang-router 0.3.2 does not take (or this test does not know): {unknown}"
        assert ns.pd_disaggregation, "the router must run in PD mode"
        prefill = [(p[0], None if len(p) < 2 or p[1] == "none" else int(p[1])) for p in ns.prefill]
        return prefill, [d[0] for d in ns.decode]
    try:
        ra = parse_router_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"sglang-router rejects the manifest's args {argv}") from exc
    assert ra.pd_disaggregation, "the router must run in PD mode"
    return list(ra.prefill_urls), list(ra.decode_urls)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_router_lists_every_pod_by_its_stable_name(overlay: Path) -> None:
    r = _render(overlay)
    nodes = r.nodes()
    containers = [c for dep in r.by_kind.get("Deployment", {}).values()
                  for c in dep["spec"]["template"]["spec"]["containers"]]
    ours = [c for c in containers if c.get("command") == ["pdcluster", "router"]]
    sglang = [c for c in containers if c.get("command", [])[-1:] == ["sglang_router.launch_router"]]
    assert len(ours) + len(sglang) == 1, "one router container expected (ours or sglang-router)"
    router = (ours or sglang)[0]
    args = [str(a) for a in router["args"]]
    prefill, decode = _parse_our_router(args) if ours else _router_workers(args)
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    for kind in ("readinessProbe", "livenessProbe"):
        probe = router[kind]["httpGet"]
        assert ports.get(probe["port"], probe["port"]) == 8000
        if ours:
            assert probe["path"] in _router_routes(), f"router {kind} path {probe['path']} is not a router route"
    listed = {"prefill": [(u, b) for u, b in prefill], "decode": [(u, None) for u in decode]}
    for role, (sts, _c, ns, _env) in nodes.items():
        svc_name = sts["spec"]["serviceName"]
        svc = r.by_kind["Service"][svc_name]["spec"]
        assert svc.get("clusterIP") == "None", f"{svc_name}: pods get DNS names only behind a headless Service"
        assert svc.get("publishNotReadyAddresses") is True
        svc_ports = {p["port"] for p in svc["ports"]}
        ordinals = []
        for url, bootstrap_port in listed[role]:
            u = urlsplit(url)
            host, _, sub = (u.hostname or "").partition(".")
            pod, _, ordinal = host.rpartition("-")
            assert (pod, sub) == (sts["metadata"]["name"], svc_name), \
                f"{role} URL {url}: expected <statefulset>-<n>.<service> = {sts['metadata']['name']}-N.{svc_name}"
            assert u.port == ns.port and u.port in svc_ports, f"{role} URL {url}: node listens on {ns.port}"
            if role == "prefill":
                assert bootstrap_port == ns.disaggregation_bootstrap_port in svc_ports, \
                    f"prefill URL {url}: bootstrap port {bootstrap_port} != {ns.disaggregation_bootstrap_port}"
            ordinals.append(int(ordinal))
        assert sorted(ordinals) == list(range(sts["spec"]["replicas"])), \
            f"{role}: the router lists pods {sorted(ordinals)} of {sts['spec']['replicas']} replicas"
    boot = nodes["prefill"][2].disaggregation_bootstrap_port
    assert nodes["decode"][2].disaggregation_bootstrap_port == boot
