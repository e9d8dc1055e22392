"""The Helm chart helm/dsv3serve: lint, render, schemas, the Serve config, bad values.

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
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml
from helm_util import (
    CHART,
    LAYOUTS,
    ROOT,
    env_of,
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
from router.config import RouterSettings, ServingConfig

RAYSERVICE_SCHEMA = (
    Path(__file__).resolve().parents[1] / "data" / "kuberay" / "rayservice-v1.schema.json"
)
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


def kuberay_validator() -> jsonschema.protocols.Validator:
    """The RayService schema, its Kubernetes $refs served from kubernetes-validate's files."""
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    defs = json.loads(
        (folder / f"v{latest_version()}-local-strict" / "_definitions.json").read_text()
    )
    registry = referencing.Resource.from_contents(defs) @ referencing.Registry()
    schema = json.loads(RAYSERVICE_SCHEMA.read_text())
    return jsonschema.Draft202012Validator(schema, registry=registry)


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


# --- bad values -----------------------------------------------------------------------


def changed(path: str, value: Any) -> dict[str, Any]:
    """The two-node PD values with the dotted ``path`` set to ``value`` (None deletes it)."""
    values = copy.deepcopy(LAYOUTS["two-node-h200-pd"])
    *parents, last = path.split(".")
    node = values
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return values


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("prefill.numReplicas", -1, r"at '/prefill/numReplicas': minimum"),
        ("decode.workers.gpus", 2.5, r"at '/decode/workers/gpus': got number, want integer"),
        ("colour", "blue", r"additional properties 'colour' not allowed"),
        ("model", None, r"at '/model': missing property 'path'"),
        ("model.path", None, r"at '/model': missing property 'path'"),
        ("kvTransfer.connector", "rdma", r"at '/kvTransfer/connector': value must be one of"),
        ("kvTransfer.connector", "shm", r"at '/kvTransfer/connector': value must be one of"),
        ("engine.page_size", 0, r"at '/engine/page_size': minimum"),
        ("router.policy", "random", r"at '/router/policy'"),
        ("gpuEnv.NCCL_NVLS_ENABLE", 0, r"at '/gpuEnv/NCCL_NVLS_ENABLE': got number, want string"),
        ("service.type", "ExternalName", r"at '/service/type'"),
        ("mode", "both", r"at '/mode': value must be one of"),
        ("prefill.groupSize", 8, r"at '/prefill': additional properties 'groupSize' not allowed"),
        ("decode.tpSize", 0, r"at '/decode/tpSize': minimum"),
        ("engine.tp_size", 8, r"at '/engine': additional properties 'tp_size' not allowed"),
        ("decode.engine.ep_size", 8, r"at '/decode/engine': additional properties 'ep_size'"),
        ("decode.layout.dp_size", 0, r"at '/decode/layout/dp_size': minimum"),
        ("decode.layout.tp_size", 8, r"at '/decode/layout': additional properties 'tp_size'"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(path: str, value: Any, message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=message):
        render(changed(path, value))


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            "decode.numReplicas",
            3,
            r"decode\.numReplicas: 3 replicas x tpSize 8 need 24 GPUs, but decode\.workers has "
            r"1 pods x 8 GPUs = 8",
        ),
        (
            "prefill.tpSize",
            16,
            r"prefill\.numReplicas: 1 replicas x tpSize 16 need 16 GPUs, but prefill\.workers",
        ),
        (
            "prefill.layout.enable_dp_attention",
            True,
            r"prefill\.layout\.enable_dp_attention: found true, expected false",
        ),
        ("rayVersion", "2.50.0", r"rayVersion: found 2\.50\.0, expected >= 2\.52\.0"),
        ("metrics.rayPort", 8001, r"metrics\.routerPort: found 8001, the same as metrics\.rayPort"),
        (
            "metrics.rayPort",
            8002,
            r"metrics\.rayPort: found 8002, one of the router metrics ports 8001\.\.8002",
        ),
    ],
)
def test_layouts_ray_cannot_place_fail_naming_the_field(
    path: str, value: Any, message: str
) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(changed(path, value))


ONE_RANK = {"tpSize": 1, "layout": {"dp_size": 1, "enable_dp_attention": False, "ep_size": 1}}


def one_rank_groups(prefill_engine: dict[str, Any], decode_engine: dict[str, Any]) -> dict:
    """The two-node PD values with one rank per replica and these role engine overrides."""
    values = copy.deepcopy(LAYOUTS["two-node-h200-pd"])
    for role, engine in (("prefill", prefill_engine), ("decode", decode_engine)):
        values[role] |= ONE_RANK | {"engine": engine}
    return values


def test_speculation_on_one_rank_groups_reaches_the_serving_config() -> None:
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
    args = serve_config(one_rank_groups(spec, spec))["applications"][0]["args"]
    cfg = ServingConfig.parse(args)
    for role in ("prefill", "decode"):
        assert cfg.worker_config(role).engine.spec_num_steps == 2


def test_speculation_on_one_role_only_fails_naming_both() -> None:
    values = one_rank_groups({}, {"speculative_algorithm": "NEXTN"})
    with pytest.raises(helm.HelmRenderError, match=r'found "" and "NEXTN", expected both set'):
        render(values)


# --- Grafana dashboards ---------------------------------------------------------------


def test_chart_dashboards_mirror_deploy_grafana() -> None:
    canonical = {p.name: p.read_bytes() for p in (ROOT / "deploy" / "grafana").glob("*.json")}
    packaged = {p.name: p.read_bytes() for p in (CHART / "dashboards").glob("*.json")}
    assert packaged.keys() == canonical.keys(), "copy deploy/grafana/*.json to the chart"
    for name, data in canonical.items():
        assert packaged[name] == data, (
            f"helm/dsv3serve/dashboards/{name} differs from deploy/grafana"
        )


def test_each_packaged_dashboard_is_a_labelled_config_map() -> None:
    maps = of_kind(render(LAYOUTS["two-node-h200-pd"]), "ConfigMap")
    packaged = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    found = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        found.update(config_map["data"])
    assert found.keys() == packaged.keys()
    for name, text in packaged.items():
        assert json.loads(found[name]) == json.loads(text)


def test_dashboard_file_names_become_config_map_names(tmp_path: Path) -> None:
    chart = Path(shutil.copytree(CHART, tmp_path / "dsv3serve"))
    board = {"title": "probe", "panels": []}  # a stand-in file, only to exercise the template
    (chart / "dashboards" / "PD_Overview.json").write_text(json.dumps(board))
    maps = {
        m["metadata"]["name"]: m
        for m in of_kind(render(LAYOUTS["two-node-h200-pd"], chart), "ConfigMap")
    }
    config_map = maps["dsv3-dsv3serve-dashboard-pd-overview"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["PD_Overview.json"]) == board
    kubernetes_validate.validate(config_map, latest_version(), strict=True)


def test_slo_values_reach_the_serving_config_the_policy_and_kuberay() -> None:
    """``slo`` and the roles' min/max replicas become the app's ``slo`` and bounds, the
    deploy config names the same app-level policy the local launcher submits, and
    KubeRay's autoscaler is on."""
    from router.autoscale.app import autoscaling_policy

    values = copy.deepcopy(LAYOUTS["two-node-h200-pd"])
    values["slo"] = {"ttftP99S": 2.0, "itlP99S": 0.1, "drainTimeoutS": 300}
    values["decode"] |= {"numReplicas": 1, "minReplicas": 1, "maxReplicas": 2}
    values["decode"]["workers"] |= {"minReplicas": 1, "maxReplicas": 2}
    service = rayservice(values)
    assert kuberay_validator().is_valid(service)
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    cfg = ServingConfig.parse(app["args"])
    assert cfg.slo is not None and cfg.slo.drain_timeout_s == 300
    assert cfg.decode.bounds() == (1, 2)
    assert app["autoscaling_policy"] == autoscaling_policy(cfg)
    assert "autoscaling_policy" not in serve_config(LAYOUTS["two-node-h200-pd"])["applications"][0]
