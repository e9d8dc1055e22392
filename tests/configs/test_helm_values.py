"""The Helm chart helm/dsv3serve: values the schema or the chart refuses (naming the field),
speculation and SLO values reaching the serving config, the packaged Grafana dashboards.

The rest of the chart (lint, schemas, the Serve config) is in test_helm.py; the tools are
listed there.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from helm_util import (
    CHART,
    LAYOUTS,
    ROOT,
    kuberay_validator,
    of_kind,
    rayservice,
    render,
    serve_config,
)
from kubernetes_validate.utils import latest_version
from ray.serve.schema import ServeDeploySchema

from router.config import ServingConfig

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
