"""The Helm chart helm/dsv3serve: lint, render, schemas, the Serve config. Bad values and
the packaged dashboards are in test_helm_values.py.

Secure defaults are in test_helm_security.py.

Real tools, offline, no cluster and no helm binary. Test dependencies (pip):
  helm-python-sdk==0.2.2      Helm v4 SDK (lint, render, values.schema.json) through ctypes
  kubernetes-validate==1.37.0 Kubernetes JSON schemas, checks Service/Secret/ConfigMap/NetworkPolicy
  jsonschema                  (already installed with ray) checks the RayService against
                              tests/data/kuberay/rayservice-v1.schema.json
The ServiceMonitor is a Prometheus-operator CRD that kubernetes-validate has no schema for; it
is only checked for its selector and port here.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from helm_util import (
    CHART,
    LAYOUTS,
    env_of,
    kuberay_validator,
    layouts,
    of_kind,
    pod_templates,
    rayservice,
    render,
    serve_config,
)
from kubernetes_validate.utils import latest_version
from plan_util import plan_published
from ray.serve.schema import ServeDeploySchema

from dsv3serve.engine.config import PARALLEL_FIELDS, EngineConfig
from router.api.admission import admission_limit
from router.api.proxy_admission import PROXY_ADMISSION_ENV
from router.config import RouterSettings, ServingConfig

K8S_VERSIONS = ("1.27.0", latest_version())  # the chart's kubeVersion floor, and the newest
CORE_KINDS = {"Service", "Secret", "ConfigMap", "NetworkPolicy"}


# --- lint and schemas -----------------------------------------------------------------


@layouts
def test_chart_lints_clean_in_strict_mode(layout: str) -> None:
    report = helm.lint(CHART, LAYOUTS[layout], strict=True, namespace="llm")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["errors"] == [] and problems == [], report


@layouts
@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_core_objects_validate_against_kubernetes_schemas(layout: str, k8s: str) -> None:
    docs = render(LAYOUTS[layout])
    core = [doc for doc in docs if doc["kind"] in CORE_KINDS]
    assert {doc["kind"] for doc in core} >= {"Service", "Secret", "NetworkPolicy"}
    for doc in core:
        kubernetes_validate.validate(doc, k8s, strict=True)


@layouts
def test_rayservice_validates_against_kuberay_schema(layout: str) -> None:
    errors = list(kuberay_validator().iter_errors(rayservice(LAYOUTS[layout])))
    assert not errors, [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def test_kuberay_schema_catches_a_misspelt_field() -> None:
    service = rayservice(LAYOUTS["two-node-h200-pd"])
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert not kuberay_validator().is_valid(service)


# --- the Serve application ------------------------------------------------------------


@layouts
def test_serve_config_validates_with_ray_and_serving_config(layout: str) -> None:
    config = serve_config(LAYOUTS[layout])
    ServeDeploySchema.model_validate(config)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert config["grpc_options"]["port"] == 9000
    for app in config["applications"]:
        assert app["import_path"] == "router.app:build_app"
        cfg = ServingConfig.parse(app["args"])
        assert cfg.mode == LAYOUTS[layout].get("mode", "pd")
        assert cfg.kv_connector in ("torch_dist", "nixl") or cfg.mode == "colocated"
        assert (cfg.router.metrics_host, cfg.router.metrics_port) == ("0.0.0.0", 8001)


def ray_start_resources(group: dict[str, Any]) -> dict[str, float]:
    """KubeRay's rayStartParams.resources: a shell-quoted JSON object."""
    return json.loads(json.loads(group["rayStartParams"]["resources"]))


@layouts
def test_each_role_fits_only_its_own_worker_group(layout: str) -> None:
    service = rayservice(LAYOUTS[layout])
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    cfg = ServingConfig.parse(args)
    assert set(groups) == set(cfg.roles())
    for role in cfg.roles():
        want, group = getattr(cfg, role), groups[role]
        offered = ray_start_resources(group)
        assert want.resources and set(want.resources) <= set(offered)
        for other in set(cfg.roles()) - {role}:
            offers = ray_start_resources(groups[other])
            assert set(want.resources).isdisjoint(offers), "a rank could land on the other role"
        gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        # a replica's tp_size ranks may span pods; all replicas fit in the role's GPUs
        ranks = want.num_replicas * cfg.worker_config(role).group_size
        assert ranks <= group["replicas"] * gpus
        # the ranks take every Ray CPU of the pod, so the router (1 CPU) runs on the head
        assert int(group["rayStartParams"]["num-cpus"]) == gpus * want.num_cpus


VARIANTS = {
    "no-auth": {"rayAuth": {"enabled": False}, "apiKey": {"enabled": False}},
    "load-balancer": {
        "service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]},
        "networkPolicy": {"routerFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]},
    },
    "bare": {
        "serviceMonitor": {"enabled": False},
        "dashboards": {"enabled": False},
        "networkPolicy": {"enabled": False},
    },
    "autoscaling": {
        "enableInTreeAutoscaling": True,
        "decode": {"workers": {"minReplicas": 1, "maxReplicas": 4}},
    },
    "nixl-and-role-engine": {
        "kvTransfer": {"connector": "nixl", "options": {}},
        "decode": {"engine": {"max_running_requests": 512}},
        "head": {"env": {"RAY_SERVE_LOG_LEVEL": "INFO"}},
    },
    "cache-volume": {
        "cache": {"volume": {"hostPath": {"path": "/var/cache/dsv3serve", "type": "Directory"}}}
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_render_valid_objects(variant: str) -> None:
    values = LAYOUTS["two-node-h200-pd"] | VARIANTS[variant]
    docs = render(values)
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, latest_version(), strict=True)
    (service,) = of_kind(docs, "RayService")
    assert kuberay_validator().is_valid(service)
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    ServingConfig.parse(config["applications"][0]["args"])


def test_switches_remove_what_they_name() -> None:
    docs = render(LAYOUTS["two-node-h200-pd"] | VARIANTS["bare"] | VARIANTS["no-auth"])
    kinds = {doc["kind"] for doc in docs}
    assert kinds == {"RayService", "Service"}  # the router Service alone
    (service,) = of_kind(docs, "RayService")
    assert "authOptions" not in service["spec"]["rayClusterConfig"]
    for template in pod_templates(service).values():
        assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "DSV3SERVE_API_KEY"}.isdisjoint(env_of(template))


@pytest.mark.parametrize(("bound", "grace"), [(None, 40), (12.5, 23)])
def test_every_pods_grace_period_follows_the_routers_graceful_bound(
    bound: float | None, grace: int
) -> None:
    """terminationGracePeriodSeconds = router.graceful_shutdown_timeout_s (default 30 s,
    rounded up) + 10 s for Serve and Ray to stop, on the head and every worker pod; the
    router deployment's Serve drain gets the same bound."""
    values = copy.deepcopy(LAYOUTS["two-node-h200-pd"])
    if bound is not None:
        values.setdefault("router", {})["graceful_shutdown_timeout_s"] = bound
    for group, template in pod_templates(rayservice(values)).items():
        assert template["spec"]["terminationGracePeriodSeconds"] == grace, group
    router_args = serve_config(values)["applications"][0]["args"]["router"]
    assert RouterSettings.model_validate(router_args).graceful_shutdown_timeout_s == (bound or 30)


def test_cache_volume_mounts_on_workers_only() -> None:
    """With ``cache.volume`` each worker pod mounts it read-write at ``cache.mountPath`` and
    gets DSV3SERVE_CACHE there (the engine points the compile caches into it); the head
    (router only) does not; without it nothing is mounted."""
    service = rayservice(LAYOUTS["two-node-h200-pd"] | VARIANTS["cache-volume"])
    for group, template in pod_templates(service).items():
        (container,) = template["spec"]["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        if group == "head":
            assert "cache" not in mounts and "DSV3SERVE_CACHE" not in env_of(template)
            continue
        assert mounts["cache"]["mountPath"] == "/cache/dsv3serve"
        assert not mounts["cache"].get("readOnly", False)
        assert volumes["cache"]["hostPath"]["path"] == "/var/cache/dsv3serve"
        assert env_of(template)["DSV3SERVE_CACHE"]["value"] == "/cache/dsv3serve"
    plain = rayservice(LAYOUTS["two-node-h200-pd"])
    for template in pod_templates(plain).values():
        assert "cache" not in {v["name"] for v in template["spec"]["volumes"]}
        assert "DSV3SERVE_CACHE" not in env_of(template)


@layouts
def test_the_proxys_door_holds_the_apps_admission_budget(layout: str) -> None:
    """The head pod (Serve's proxy) gets router.num_replicas x max_in_flight +
    max_queued_requests as the door's budget (router/api/proxy_admission.py); with no
    queue limit it gets none."""
    head = pod_templates(rayservice(LAYOUTS[layout]))["head"]
    budget = admission_limit([serving(layout).router])
    assert env_of(head)[PROXY_ADMISSION_ENV]["value"] == str(budget)
    values = copy.deepcopy(LAYOUTS[layout])
    values.setdefault("router", {})["max_queued_requests"] = -1
    head = pod_templates(rayservice(values))["head"]
    assert PROXY_ADMISSION_ENV not in env_of(head)


def serving(layout: str) -> ServingConfig:
    return ServingConfig.parse(serve_config(LAYOUTS[layout])["applications"][0]["args"])


def layout_of(cfg: ServingConfig, role: str) -> tuple[int, int, bool, int]:
    """(tp_size, dp_size, enable_dp_attention, ep_size) of ``role``'s engine."""
    p = cfg.worker_config(role).engine.parallel
    return p.tp_size, p.dp_size, p.enable_dp_attention, p.ep_size


def pods_of(layout: str, role: str) -> tuple[int, int]:
    """(pods, GPUs per pod) of ``role``'s worker group in a values file."""
    workers = LAYOUTS[layout][role]["workers"]
    return workers["replicas"], workers["gpus"]


def test_values_files_describe_the_three_layouts() -> None:
    one = serving("one-node-h200-colocated")
    assert one.roles() == ("colocated",) and one.colocated.num_replicas == 1
    assert layout_of(one, "colocated") == (8, 8, True, 8)
    assert pods_of("one-node-h200-colocated", "colocated") == (1, 8)
    pd = serving("two-node-h200-pd")
    assert (pd.prefill.num_replicas, pd.decode.num_replicas) == (1, 1)
    assert layout_of(pd, "prefill") == (8, 1, False, 8)
    assert layout_of(pd, "decode") == (8, 8, True, 8)
    assert pods_of("two-node-h200-pd", "prefill") == pods_of("two-node-h200-pd", "decode") == (1, 8)
    ep16 = serving("two-node-h100-ep16")
    assert layout_of(ep16, "colocated") == (16, 16, True, 16)
    assert pods_of("two-node-h100-ep16", "colocated") == (2, 8)  # the group spans both pods
    defaults = serving("chart-defaults")  # the two-node H200 PD layout
    assert [defaults.worker_config(r) for r in ("prefill", "decode")] == [
        pd.worker_config(r) for r in ("prefill", "decode")
    ]


# GPU memory (GB, as the planner counts) by the nodeSelector's nvidia.com/gpu.product.
GPU_MEMORY_GB = {"NVIDIA-H200": 141, "NVIDIA-H100-80GB-HBM3": 80}


@layouts
def test_every_layout_fits_the_published_model_on_its_gpus(layout: str) -> None:
    cfg, values = serving(layout), LAYOUTS[layout]
    for role in cfg.roles():
        selector = values.get(role, {}).get("workers", {}).get("nodeSelector", {})
        product = selector.get("nvidia.com/gpu.product", "NVIDIA-H200")  # defaults: H200
        engine = cfg.worker_config(role).engine
        # group graphs and overlap stay off until a multi-GPU run passes (issue 16)
        assert engine.disable_cuda_graph and not engine.overlap_schedule
        plan_published(engine, GPU_MEMORY_GB[product])


def test_engine_and_router_schemas_track_the_config_classes() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    engine_keys = set(schema["definitions"]["engine"]["properties"])
    assert engine_keys == set(EngineConfig.model_fields) - {"model", *PARALLEL_FIELDS}
    layout_keys = set(schema["definitions"]["layout"]["properties"])
    assert layout_keys == set(PARALLEL_FIELDS) - {"tp_size"}  # tp_size is <role>.tpSize
    chart_set = {"metrics_host", "metrics_port"}  # from metrics.routerPort, bound to the pod IP
    router_keys = set(schema["properties"]["router"]["properties"])
    assert router_keys == set(RouterSettings.model_fields) - chart_set
