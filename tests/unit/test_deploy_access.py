"""The Kubernetes manifests' access control: every container gets the cluster secret (and the
router its API key) from the Secret, and the NetworkPolicies admit exactly the router and the
other nodes to a node's ports. Renders the overlays with the helpers of test_deploy_manifests.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.auth import SecretError, check_secret
from tests.unit.test_deploy_manifests import K8S, OVERLAYS, Rendered, _render

def _secret_ref(r: Rendered, c: dict, var: str) -> tuple[str, str]:
    """(Secret name, key) that env ``var`` of container ``c`` reads; the Secret must have that key."""
    (entry,) = [e for e in c.get("env", []) if e["name"] == var] or [None]
    assert entry is not None, f"container {c['name']} has no {var}"
    ref = entry.get("valueFrom", {}).get("secretKeyRef")
    assert ref is not None and "value" not in entry, f"container {c['name']}: {var} must come from a Secret"
    secret = r.by_kind.get("Secret", {}).get(ref["name"])
    assert secret is not None, f"container {c['name']}: {var} reads missing Secret {ref['name']}"
    assert ref["key"] in secret.get("data", {}), f"Secret {ref['name']} has no key {ref['key']}"
    assert not ref.get("optional"), f"{var} must not be optional: a missing Secret would silently turn auth off"
    return ref["name"], ref["key"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_every_container_gets_the_cluster_secret_and_the_router_its_key(overlay: Path) -> None:
    r = _render(overlay)
    refs = set()
    for role, (_sts, c, _ns, _env) in r.nodes().items():
        refs.add(_secret_ref(r, c, "PDC_CLUSTER_SECRET"))
    (router,) = [c for dep in r.by_kind["Deployment"].values() for c in dep["spec"]["template"]["spec"]["containers"]]
    refs.add(_secret_ref(r, router, "PDC_CLUSTER_SECRET"))
    assert len(refs) == 1, f"nodes and router read different cluster secrets: {refs}"
    if router.get("command") == ["pdcluster", "router"]:
        (name, key) = _secret_ref(r, router, "PDC_API_KEY")
        assert key != next(iter(refs))[1], "the client API key must not be the cluster secret"
    else:  # sglang-router: one key, sent to the workers as a bearer token too
        args = [str(a) for a in router["args"]]
        assert args[args.index("--api-key") + 1] == "$(PDC_CLUSTER_SECRET)"


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] in ("In", "NotIn", "Exists"), e
        if e["operator"] == "In":
            ok = ok and labels.get(e["key"]) in e["values"]
        elif e["operator"] == "NotIn":
            ok = ok and labels.get(e["key"]) not in e["values"]
        else:
            ok = ok and e["key"] in labels
    return ok


def _pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_network_policy_admits_only_the_router_and_the_other_nodes(overlay: Path) -> None:
    r = _render(overlay)
    nodes = r.nodes()
    router = _pod_labels(r.by_kind["Deployment"]["router"])
    node_labels = {role: _pod_labels(sts) for role, (sts, *_rest) in nodes.items()}
    http_ports = {ns.port for (_s, _c, ns, _e) in nodes.values()}
    # The router also subscribes to the prefills' KV events (exact cache-aware routing), on the
    # fixed --kv-events-port the manifests give them.
    kv_ports = {getattr(ns, "kv_events_port", 0) for (_s, _c, ns, _e) in nodes.values()} - {0}
    assert kv_ports, "the prefills' KV-event port must be fixed for the policy to admit the router there"
    policies = list(r.by_kind.get("NetworkPolicy", {}).values())
    for role, labels in node_labels.items():
        mine = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        assert mine, f"no NetworkPolicy selects the {role} pods: anyone in the cluster may reach them"
        for policy in mine:
            assert "Ingress" in policy["spec"]["policyTypes"]
            for rule in policy["spec"].get("ingress", []):
                peers = rule.get("from")
                assert peers, f"{policy['metadata']['name']}: a rule without 'from' admits every source"
                for peer in peers:
                    assert set(peer) == {"podSelector"}, f"{policy['metadata']['name']}: only pods of this namespace"
                    admits_router = _selects(peer["podSelector"], router)
                    admits_nodes = {_selects(peer["podSelector"], lab) for lab in node_labels.values()}
                    assert admits_router or admits_nodes == {True}, f"{peer} admits neither the router nor the nodes"
                    assert not _selects(peer["podSelector"], {"app.kubernetes.io/name": "pdcluster"}), \
                        "a peer selector that admits any pdcluster pod (or any pod)"
                    if admits_router and admits_nodes != {True}:  # the router: the HTTP and KV-event ports only
                        assert {p["port"] for p in rule.get("ports", [])} == http_ports | kv_ports, rule
    # and the selectors really admit what the cluster needs: router -> HTTP, node <-> node everything
    rules = [rule for p in policies if _selects(p["spec"]["podSelector"], node_labels["decode"])
             for rule in p["spec"]["ingress"]]
    assert any(_selects(peer["podSelector"], router) for rule in rules for peer in rule["from"])
    assert any(all(_selects(peer["podSelector"], lab) for lab in node_labels.values()) and "ports" not in rule
               for rule in rules for peer in rule["from"]), "prefill and decode must reach each other on any port"


def test_the_base_ships_no_usable_secret() -> None:
    """The base's pdcluster-auth values are public placeholders: a pod started with one refuses
    to start (exit 2 naming the variable), instead of running with a secret everyone knows."""
    text = (K8S / "base" / "kustomization.yaml").read_text()
    values = re.findall(r"^\s+- (?:cluster-secret|api-key|operator-key)=(\S+)$", text, re.M)
    assert len(values) == 3, values
    for value in values:
        with pytest.raises(SecretError, match="placeholder"):
            check_secret(value, "PDC_CLUSTER_SECRET")
