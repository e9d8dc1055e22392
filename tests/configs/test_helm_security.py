"""The Helm chart's secure defaults: services, Ray token auth, network policies, secrets.

Rendered offline with helm-python-sdk (see test_helm.py for the tools).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from helm_util import (
    LAYOUTS,
    env_of,
    layouts,
    of_kind,
    pod_templates,
    rayservice,
    render,
)

from router.api.proxy_middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV

INTERNAL_PORTS = {6379, 8265, 10001, 52365}  # GCS, dashboard, Ray client, dashboard agent
METRICS_PORTS = {8001, 8002, 8080}  # router replicas 0 and 1 (8001 + rank), Ray's exporter


# --- secure defaults ------------------------------------------------------------------


def service_ports(service: dict[str, Any]) -> set[int]:
    return {p["port"] for p in service["spec"]["ports"]} | {
        p["targetPort"] for p in service["spec"]["ports"] if isinstance(p.get("targetPort"), int)
    }


@layouts
def test_router_service_exposes_only_http_and_grpc(layout: str) -> None:
    services = {s["metadata"]["name"]: s for s in of_kind(render(LAYOUTS[layout]), "Service")}
    router = services["dsv3-dsv3serve"]
    assert router["spec"]["type"] == "ClusterIP"
    assert [(p["port"], p["targetPort"]) for p in router["spec"]["ports"]] == [
        (8000, "serve"),
        (9000, "grpc"),
    ]
    for service in services.values():
        assert service_ports(service).isdisjoint(INTERNAL_PORTS), service["metadata"]["name"]
        assert service["spec"]["type"] == "ClusterIP" or service is router
    metrics = services["dsv3-dsv3serve-metrics"]
    assert metrics["spec"]["clusterIP"] == "None" and service_ports(metrics) == METRICS_PORTS


@layouts
def test_kuberay_head_service_and_dashboard_stay_internal(layout: str) -> None:
    cluster = rayservice(LAYOUTS[layout])["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and head["enableIngress"] is False
    # KubeRay deploys serveConfigV2 through the dashboard on the pod IP; the NetworkPolicy
    # limits that port to the operator's namespace and Ray's token guards it.
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert cluster["enableInTreeAutoscaling"] is False
    for template in pod_templates(rayservice(LAYOUTS[layout])).values():
        assert template["spec"]["automountServiceAccountToken"] is False


@layouts
def test_ray_token_auth_on_every_ray_container(layout: str) -> None:
    service = rayservice(LAYOUTS[layout])
    secret = "dsv3-dsv3serve-ray-auth"
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {
        "mode": "token",
        "secretName": secret,
    }
    for group, template in pod_templates(service).items():
        env = env_of(template)
        assert env["RAY_AUTH_MODE"]["value"] == "token", group
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret, "key": "auth_token"}, group
        assert ("DSV3SERVE_API_KEY" in env) == (group == "head")
    secrets = {s["metadata"]["name"]: s for s in of_kind(render(LAYOUTS[layout]), "Secret")}
    assert len(secrets[secret]["data"]["auth_token"]) >= 48


def policies(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    docs = of_kind(render(values), "NetworkPolicy")
    return {p["metadata"]["name"].removeprefix("dsv3-dsv3serve-"): p["spec"] for p in docs}


def rule_ports(rule: dict[str, Any]) -> set[int] | None:
    """The ports a rule opens; None means every port."""
    return {p["port"] for p in rule["ports"]} if "ports" in rule else None


@layouts
def test_network_policies_fence_the_release(layout: str) -> None:
    specs = policies(LAYOUTS[layout])
    release = {"app.kubernetes.io/name": "dsv3serve", "app.kubernetes.io/instance": "dsv3"}
    for spec in specs.values():
        assert spec["policyTypes"] == ["Ingress"]
        assert release.items() <= spec["podSelector"]["matchLabels"].items()
    (internal,) = specs["internal"]["ingress"]
    assert internal["from"] == [{"podSelector": {"matchLabels": release}}]
    open_rules = [r for s in specs.values() for r in s["ingress"] if "from" not in r]
    assert [rule_ports(r) for r in open_rules] == [{8000, 9000}]  # the only rule from anywhere
    assert specs["router"]["podSelector"]["matchLabels"]["dsv3serve.io/role"] == "head"
    (operator,) = specs["operator"]["ingress"]
    assert rule_ports(operator) == {8265}
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kuberay-system"
    }
    (scrape,) = specs["metrics"]["ingress"]
    assert rule_ports(scrape) == METRICS_PORTS
    assert "monitoring" in json.dumps(scrape["from"])


def test_service_monitor_scrapes_the_metrics_service() -> None:
    docs = render(LAYOUTS["two-node-h200-pd"])
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (metrics,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"].endswith("-metrics")]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    )
    ports = {p["name"]: p["targetPort"] for p in metrics["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == list(ports)
    head = pod_templates(of_kind(docs, "RayService")[0])["head"]["spec"]["containers"][0]
    assert set(ports.values()) <= {p["name"] for p in head["ports"]}


def test_existing_secrets_are_referenced_not_created() -> None:
    values = copy.deepcopy(LAYOUTS["two-node-h200-pd"])
    values["rayAuth"] = {"existingSecret": "ray-token"}
    values["apiKey"] = {"existingSecret": "llm-keys", "secretKey": "key"}
    docs = render(values)
    assert of_kind(docs, "Secret") == []
    env = env_of(pod_templates(of_kind(docs, "RayService")[0])["head"])
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ray-token"
    assert env["DSV3SERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "llm-keys",
        "key": "key",
    }


def test_given_api_key_is_stored() -> None:
    values = {**LAYOUTS["two-node-h200-pd"], "apiKey": {"value": "sk-test-123"}}
    (secret,) = [
        s for s in of_kind(render(values), "Secret") if s["metadata"]["name"].endswith("-api-key")
    ]
    assert secret["data"]["api-key"] == "c2stdGVzdC0xMjM="  # base64 of sk-test-123


def test_each_router_replica_gets_a_scraped_metrics_port_and_the_proxy_middleware() -> None:
    values = copy.deepcopy(LAYOUTS["two-node-h200-pd"])
    values["router"] = {**values.get("router", {}), "num_replicas": 3}
    docs = render(values)
    head = pod_templates(of_kind(docs, "RayService")[0])["head"]
    router_ports = {
        p["name"]: p["containerPort"]
        for p in head["spec"]["containers"][0]["ports"]
        if p["name"].startswith("rtr-metrics-")
    }
    assert router_ports == {"rtr-metrics-0": 8001, "rtr-metrics-1": 8002, "rtr-metrics-2": 8003}
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {*router_ports, "ray-metrics"}
    env = env_of(head)
    assert env[PROXY_CALLBACK_ENV]["value"] == PROXY_CALLBACK
