"""Serve deploy configs: Ray's own schema, our ServingConfig, and the README main command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from http_util import spare_port
from plan_util import plan_published
from ray.serve.schema import ServeDeploySchema

from dsv3serve.engine.config import EngineConfig
from dsv3serve.plan.report import plan_table
from router.config import ConfigError, ServingConfig
from router.launch import load_deploy_file, local_pd_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FILES = sorted(DEPLOY.glob("*.yaml"))
# GPU memory (GB, as the planner counts) of each GPU deploy file's cards: the files for the
# published checkpoint, and the test beds (dummy full-width weights, fewer layers).
GPU_FILES = {
    "h200x8-colocated.yaml": 141,
    "two-node-h200-pd.yaml": 141,
    "two-node-h100-ep16.yaml": 80,
}
TESTBED_FILES = {"h200x2-pd.yaml": 141, "h200x2-dp2ep2.yaml": 141}


def test_the_expected_deploy_files_exist() -> None:
    names = {f.name for f in FILES}
    assert {"local-pd.yaml", "local-colocated.yaml", *GPU_FILES} <= names
    gpu_files = {f.name for f in FILES if serving_config(f).engine.device.startswith("cuda")}
    assert gpu_files == set(GPU_FILES) | set(TESTBED_FILES), "give every GPU file its memory here"


def serving_config(path: Path) -> ServingConfig:
    (app,) = yaml.safe_load(path.read_text())["applications"]
    return ServingConfig.parse(app["args"])


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


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_role_of_a_deploy_file_has_a_valid_worker_config(path: Path) -> None:
    cfg = serving_config(path)
    for role in cfg.roles():
        worker = cfg.worker_config(role)
        assert worker.group_size == worker.engine.tp_size == worker.engine.parallel.world_size


def test_two_node_h200_pd_pins_groups_to_different_nodes() -> None:
    cfg = serving_config(DEPLOY / "two-node-h200-pd.yaml")
    assert cfg.prefill.resources.keys().isdisjoint(cfg.decode.resources.keys())
    assert cfg.kv_connector == "torch_dist"
    prefill, decode = (cfg.worker_config(r).engine.parallel for r in ("prefill", "decode"))
    assert (prefill.tp_size, prefill.dp_size, prefill.ep_size) == (8, 1, 8)
    assert (decode.tp_size, decode.dp_size, decode.ep_size) == (8, 8, 8)
    assert decode.enable_dp_attention and not prefill.enable_dp_attention


@pytest.mark.parametrize(
    ("name", "ranks"), [("h200x8-colocated.yaml", 8), ("two-node-h100-ep16.yaml", 16)]
)
def test_colocated_gpu_files_run_dp_attention_with_ep_over_every_rank(
    name: str, ranks: int
) -> None:
    cfg = serving_config(DEPLOY / name)
    layout = cfg.worker_config("colocated").engine.parallel
    assert cfg.mode == "colocated" and cfg.colocated.num_replicas == 1
    assert (layout.tp_size, layout.dp_size, layout.ep_size) == (ranks, ranks, ranks)
    assert layout.enable_dp_attention


@pytest.mark.parametrize(("name", "gpu_memory_gb"), sorted(GPU_FILES.items()))
def test_gpu_deploy_file_layouts_fit_the_published_model(name: str, gpu_memory_gb: int) -> None:
    cfg = serving_config(DEPLOY / name)
    for role in cfg.roles():
        engine = cfg.worker_config(role).engine
        assert engine.model == "/models/DeepSeek-V3" and engine.tp_size > 1
        # multi-rank groups run without CUDA graphs and overlap: the files must say so
        assert engine.disable_cuda_graph and not engine.overlap_schedule
        plan_published(engine, gpu_memory_gb)


@pytest.mark.parametrize(("name", "gpu_memory_gb"), sorted(TESTBED_FILES.items()))
def test_testbed_files_run_dummy_full_width_layers_on_one_host_of_two_gpus(
    name: str, gpu_memory_gb: int
) -> None:
    """The two-GPU test beds: the published widths with fewer layers and dummy weights, one
    GPU per rank, two GPUs in all, the GPU backends on, and the plan fits."""
    cfg = serving_config(DEPLOY / name)
    gpus = 0.0
    for role in cfg.roles():
        group, engine = getattr(cfg, role), cfg.worker_config(role).engine
        gpus += group.num_replicas * engine.tp_size * group.num_gpus
        assert (engine.model, engine.load_format) == ("deepseek-v3", "dummy")
        assert set(engine.hf_overrides or {}) <= {"num_hidden_layers", "num_nextn_predict_layers"}
        assert (engine.attention_backend, engine.moe_backend) == ("flashinfer", "triton")
        assert engine.overlap_schedule
        plan_published(engine, gpu_memory_gb)
    assert gpus == 2
    if cfg.mode == "pd":
        assert cfg.kv_connector == "torch_dist"
        assert not cfg.worker_config("decode").engine.disable_cuda_graph


@pytest.mark.parametrize("name", sorted(TESTBED_FILES))
def test_testbed_header_pastes_the_plan_of_its_decode_or_colocated_layout(name: str) -> None:
    text, cfg = (DEPLOY / name).read_text(), serving_config(DEPLOY / name)
    engine = cfg.worker_config("decode" if cfg.mode == "pd" else "colocated").engine
    p = engine.parallel
    overrides = json.dumps(engine.hf_overrides)
    flags = f"--tp-size {p.tp_size}"
    flags += f" --dp-size {p.dp_size} --enable-dp-attention" if p.enable_dp_attention else ""
    command = (
        f"# $ dsv3serve plan --model deepseek-v3 --hf-overrides '{overrides}' {flags} "
        f"--ep-size {p.ep_size} --gpu-memory-gb {TESTBED_FILES[name]} "
        f"--cuda-graph-max-bs {engine.cuda_graph_max_bs}\n"
    )
    assert command in text
    printed = plan_table(plan_published(engine, TESTBED_FILES[name]), "deepseek-v3")
    assert "\n".join("# " + line for line in printed.splitlines()) in text


@pytest.mark.parametrize("name", sorted(GPU_FILES))
def test_gpu_deploy_file_header_pastes_the_plan_of_each_layout(name: str) -> None:
    """The header's ``dsv3serve plan`` lines name each role's layout and the file's GPU."""
    text, cfg = (DEPLOY / name).read_text(), serving_config(DEPLOY / name)
    for role in cfg.roles():
        p = cfg.worker_config(role).engine.parallel
        flags = f"--tp-size {p.tp_size}"
        flags += f" --dp-size {p.dp_size} --enable-dp-attention" if p.enable_dp_attention else ""
        command = f"# $ dsv3serve plan --model deepseek-v3 {flags} --ep-size {p.ep_size} "
        assert f"{command}--gpu-memory-gb {GPU_FILES[name]} --disable-cuda-graph\n" in text


def test_four_rank_groups_of_the_published_model_do_not_fit_an_h200() -> None:
    """Why no file splits one 8xH200 node into two groups of 4 (prefill + decode)."""
    engine = EngineConfig(model="/models/DeepSeek-V3", device="cuda", tp_size=4, ep_size=4)
    with pytest.raises(ValueError, match=r"layout tp 4, ep 4 does not fit"):
        plan_published(engine, 141)


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
            {"decode": {"group_size": 2}},
            r"decode: .*group_size was replaced by engine\.tp_size",
        ),
        (
            {"prefill": {"engine": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}}},
            r"prefill: engine\.enable_dp_attention: a prefill group publishes KV from rank 0",
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
    port = spare_port()
    done = subprocess.run(
        [sys.executable, "-m", "dsv3serve.cli", "serve", "--port", str(port), "--check"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"dsv3serve is up at http://127.0.0.1:{port}; one chat completion: '" in done.stdout
