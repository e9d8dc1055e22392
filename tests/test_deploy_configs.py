"""Serve deploy configs: Ray's own schema, our ServingConfig, and the README main command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from http_util import free_socket
from ray.serve.schema import ServeDeploySchema

from router.config import ConfigError, ServingConfig
from router.launch import load_deploy_file, local_pd_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
FILES = sorted(DEPLOY.glob("*.yaml"))


def test_the_expected_deploy_files_exist() -> None:
    names = {f.name for f in FILES}
    assert {"local-pd.yaml", "local-colocated.yaml", "h200x8-pd.yaml", "two-node-pd.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_deploy_file_validates_with_ray_and_our_schema(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(data)
    for app in data["applications"]:
        assert app["import_path"] == "router.app:build_app"
        ServingConfig.parse(app["args"])
    assert "dashboard" not in path.read_text()  # internal ports stay unpublished


def test_embedded_default_is_deploy_local_pd() -> None:
    assert local_pd_config() == yaml.safe_load((DEPLOY / "local-pd.yaml").read_text())


def test_two_node_example_pins_groups_to_different_nodes() -> None:
    args = yaml.safe_load((DEPLOY / "two-node-pd.yaml").read_text())["applications"][0]["args"]
    cfg = ServingConfig.parse(args)
    assert cfg.prefill.resources.keys().isdisjoint(cfg.decode.resources.keys())
    assert cfg.kv_connector == "torch_dist"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"mode": "both"}, "mode"),
        ({"prefill": {"num_replicas": 0}}, "prefill.num_replicas"),
        ({"engine": {"model": "tiny", "page_size": 0}}, "engine.page_size"),
        ({"router": {"policy": "random"}}, "router.policy"),
        ({"kv_connector": "rdma"}, "kv_connector"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_config_errors_name_the_field(change: dict, field: str) -> None:
    args = {**local_pd_config()["applications"][0]["args"], **change}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ServingConfig.parse(args)


def test_mtp_example_turns_speculation_on_for_both_roles() -> None:
    args = yaml.safe_load((DEPLOY / "local-pd-mtp.yaml").read_text())["applications"][0]["args"]
    cfg = ServingConfig.parse(args)
    for role in ("prefill", "decode"):
        engine = cfg.worker_config(role).engine
        assert (engine.speculative_algorithm, engine.spec_num_steps) == ("NEXTN", 2)


SPEC = {"model": "tiny", "speculative_algorithm": "NEXTN"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"engine": SPEC, "decode": {"group_size": 2}},
            r"decode\.group_size: found 2 with engine\.speculative_algorithm NEXTN, expected "
            "group_size 1",
        ),
        (
            {"prefill": {"group_size": 4, "engine": {"speculative_algorithm": "EAGLE"}}},
            r"prefill\.group_size: found 4 with engine\.speculative_algorithm EAGLE",
        ),
        (
            {"decode": {"engine": {"speculative_algorithm": "NEXTN"}}},
            r"prefill\.engine\.speculative_algorithm \(None\) and "
            r"decode\.engine\.speculative_algorithm \(NEXTN\): expected both set or both unset",
        ),
        (
            {"engine": SPEC, "prefill": {"engine": {"speculative_algorithm": None}}},
            r"prefill\.engine\.speculative_algorithm \(None\) and decode",
        ),
        ({"decode": {"engine": {"page_size": 0}}}, r"decode\.engine\.page_size"),
        (
            {"decode": {"engine": {"speculative_num_steps": 2}}},
            r"decode\.engine: speculative_num_steps: set speculative_algorithm",
        ),
    ],
)
def test_speculation_and_role_engines_are_checked_naming_the_fields(
    change: dict, message: str
) -> None:
    args = {**local_pd_config()["applications"][0]["args"], **change}
    with pytest.raises(ConfigError, match=message):
        ServingConfig.parse(args)


def test_colocated_speculation_on_one_rank_is_accepted() -> None:
    args = {**local_pd_config()["applications"][0]["args"], "mode": "colocated", "engine": SPEC}
    assert ServingConfig.parse(args).worker_config("colocated").engine.spec_num_steps == 3


def test_deploy_file_errors_name_the_file_and_field(tmp_path: Path) -> None:
    data = local_pd_config()
    data["applications"][0]["args"]["decode"] = {"num_cpus": -1}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"bad\.yaml.*decode\.num_cpus"):
        load_deploy_file(path)


def test_serve_command_starts_the_default_pd_app_and_answers() -> None:
    """The README's main command, with --check: start, answer one chat request, stop."""
    port = free_socket().getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "dsv3serve.cli", "serve", "--port", str(port), "--check"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"dsv3serve is up at http://127.0.0.1:{port}; one chat completion: '" in done.stdout
