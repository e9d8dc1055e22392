"""Rendering the Helm chart helm/dsv3serve for its tests (helm-python-sdk, offline)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import referencing
import yaml
from kubernetes_validate.utils import latest_version

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "dsv3serve"
VALUES_DIR = ROOT / "helm" / "values"
LAYOUTS = {
    **{p.stem: yaml.safe_load(p.read_text()) for p in sorted(VALUES_DIR.glob("*.yaml"))},
    "chart-defaults": {"model": {"path": "/models/DeepSeek-V3"}},
}
layouts = pytest.mark.parametrize("layout", sorted(LAYOUTS))


def render(values: dict[str, Any], chart: Path = CHART) -> list[dict[str, Any]]:
    """Every object the chart renders for ``values`` (release dsv3, namespace llm)."""
    with helm.Chart.load(chart) as loaded:
        manifests = loaded.render(values, name="dsv3", namespace="llm", is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def rayservice(values: dict[str, Any]) -> dict[str, Any]:
    (only,) = of_kind(render(values), "RayService")
    return only


def serve_config(values: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice(values)["spec"]["serveConfigV2"])


def pod_templates(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod template per group name ('head', then 'prefill' and 'decode' or 'colocated')."""
    cluster = service["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    return {"head": cluster["headGroupSpec"]["template"], **groups}


def env_of(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (container,) = template["spec"]["containers"]
    return {e["name"]: e for e in container.get("env") or []}


RAYSERVICE_SCHEMA = ROOT / "tests" / "data" / "kuberay" / "rayservice-v1.schema.json"


def kuberay_validator() -> jsonschema.protocols.Validator:
    """The RayService schema, its Kubernetes $refs served from kubernetes-validate's files."""
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    defs = json.loads(
        (folder / f"v{latest_version()}-local-strict" / "_definitions.json").read_text()
    )
    registry = referencing.Resource.from_contents(defs) @ referencing.Registry()
    schema = json.loads(RAYSERVICE_SCHEMA.read_text())
    return jsonschema.Draft202012Validator(schema, registry=registry)
