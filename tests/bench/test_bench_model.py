"""``dsv3serve bench model`` end to end at the tiny preset on CPU, and its arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from attention_cases import DEEPSEEK_ATTENTION

from dsv3serve.bench.model.batches import context_batch, kv_tokens_needed, seq_stride
from dsv3serve.bench.model.layer_graphs import LayerGraphTimer
from dsv3serve.bench.model.plan import Plan
from dsv3serve.bench.model.points import ModelBench, spec_summary
from dsv3serve.bench.model.profile import (
    profile_graphs,
)
from dsv3serve.bench.model.roofline import (
    attention_decode_bytes,
    mlp_decode_bytes,
)
from dsv3serve.bench.model.run import guarded
from dsv3serve.bench.model.setup import (
    BENCH_PRESETS,
    Footprint,
    auto_num_moe_layers,
    bench_model_config,
    build_fitting_runner,
    build_runner,
    fill_kv_random,
    footprint,
)
from dsv3serve.cli import main
from dsv3serve.config import ModelConfig
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions
from dsv3serve.model.weights import init_dummy

TINY_RUN = [
    "bench", "model", "--preset", "tiny", "--device", "cpu", "--num-moe-layers", "2",
    "--prefill-lens", "48", "--decode-batch-sizes", "1", "3", "--decode-contexts", "20", "40",
    "--mtp-batch-sizes", "1", "2", "--mtp-context", "20", "--warmup", "1", "--iters", "2",
    "--page-size", "16", "--profile-graphs",
]  # fmt: skip


def _positive(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench_model") / "bench_model.json"
    assert main([*TINY_RUN, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_no_point_failed(tiny_result: dict[str, Any]) -> None:
    rows = [*tiny_result["prefill"], *tiny_result["decode"], *tiny_result["mtp"]["rows"]]
    assert [r["error"] for r in rows if "error" in r] == []


def test_records_environment_ceilings_and_config(tiny_result: dict[str, Any]) -> None:
    env, cfg = tiny_result["environment"], tiny_result["config"]
    assert {"device", "torch", "triton", "flashinfer", "date"} <= env.keys()
    assert _positive(tiny_result["ceilings"]["copy_TBps"])
    assert (cfg["num_dense_layers"], cfg["num_moe_layers"], cfg["mtp"]) == (1, 2, True)
    assert cfg["attention_backend"] == "torch" and cfg["cuda_graph"] is False
    assert "eager" in cfg["timing"] and "61" in cfg["projection"]
    assert _positive(tiny_result["memory"]["weights_GB"])


def test_prefill_rows(tiny_result: dict[str, Any]) -> None:
    (row,) = tiny_result["prefill"]
    assert row["input_len"] == 48
    assert _positive(row["ms"]) and _positive(row["tokens_per_s"])
    assert set(row["parts_ms"]) == {"embed", "layer0", "layer1", "layer2", "head"}
    assert row["projected_61"]["ms"] > row["ms"]  # 61 layers cost more than 3


def test_decode_rows_have_per_layer_rooflines(tiny_result: dict[str, Any]) -> None:
    rows = tiny_result["decode"]
    assert [(r["batch_size"], r["context"]) for r in rows] == [(1, 20), (3, 20), (1, 40), (3, 40)]
    for r in rows:
        assert [x["kind"] for x in r["layers"]] == ["dense", "moe", "moe"]
        for part in [*r["layers"], r["head"]]:
            assert _positive(part["ms"]) and _positive(part["roofline_ms"])
            assert part["ratio"] == pytest.approx(part["ms"] / part["roofline_ms"])
        assert _positive(r["ratio"]) and _positive(r["projected_61"]["ratio"])
        assert _positive(r["projected_61"]["tokens_per_s"])
    # more context, more KV to read: every layer's roofline grows
    short, long = rows[0]["layers"], rows[2]["layers"]
    assert all(a["bytes"] < b["bytes"] for a, b in zip(short, long, strict=True))


def test_mtp_costs_and_speedups(tiny_result: dict[str, Any]) -> None:
    mtp = tiny_result["mtp"]
    assert [r["batch_size"] for r in mtp["rows"]] == [1, 2]
    for r in mtp["rows"]:
        assert _positive(r["draft_ms"]) and _positive(r["decode_ms"])
        assert all(_positive(r["verify_ms"][k]) for k in ("1", "2", "3"))
        assert all(_positive(v) for v in r["projected_61"]["verify_ms"].values())
    for key in ("speedup", "speedup_projected_61"):
        rows = mtp[key]
        assert len(rows) == 6  # 2 batch sizes x 3 draft step counts
        for row in rows:
            assert _positive(row["break_even_accept_length"])
            k, speedups = row["num_steps"], row["speedup"]
            assert list(speedups) == ["1.0", "1.5", "2.0", "2.5", "3.0", "3.5", "4.0"]
            assert all((s is None) == (float(a) > k + 1) for a, s in speedups.items())
    assert all(r["graph"] is None for r in mtp["rows"])  # no CUDA graphs on the CPU
    assert mtp["speedup_graph"] == [] and mtp["speedup_graph_61"] == []


def test_profile_graphs_skipped_without_cuda(tiny_result: dict[str, Any]) -> None:
    assert tiny_result["profile_graphs"] == {"profile": "graphs", "skipped": "no CUDA device"}
    assert "58 - n_moe" in tiny_result["config"]["projection_graph"]


def _tiny_model(num_moe: int) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(
        bench_model_config("tiny", num_moe, mtp=True), ModelOptions(dtype=torch.float32)
    )
    init_dummy(model)
    return model


def test_decode_bytes_count_what_the_absorbed_step_reads() -> None:
    model = _tiny_model(1)
    attn, moe = model.layers[1].self_attn, model.layers[1].mlp
    all_attn = sum(p.nbytes for p in attn.parameters())
    kv_b = sum(p.nbytes for p in attn.kv_b_proj.parameters())
    absorbed = attn.w_uk.nbytes + attn.w_uv.nbytes
    assert attention_decode_bytes(attn) == all_attn - kv_b + absorbed
    ex = moe.experts
    per_expert = sum(p.nbytes for p in ex.parameters()) / ex.num_experts
    rest = sum(p.nbytes for p in moe.gate.parameters()) + sum(
        p.nbytes for p in moe.shared_experts.parameters()
    )
    k = model.cfg.num_experts_per_tok
    assert mlp_decode_bytes(moe, 1) == pytest.approx(rest + k * per_expert)
    assert mlp_decode_bytes(moe, 10_000) == pytest.approx(rest + ex.num_experts * per_expert)


def test_footprint_matches_the_built_model() -> None:
    fp = footprint("tiny", True, torch.float32, kv_tokens=64, kv_dtype=torch.float32)
    for num_moe in (1, 2):
        model = _tiny_model(num_moe)
        derived = sum(layer.self_attn.w_uk.nbytes * 2 for layer in model.layers)
        derived += model.nextn.block.self_attn.w_uk.nbytes * 2
        built = sum(p.nbytes for p in model.parameters()) + derived
        assert fp.fixed_bytes + num_moe * fp.moe_layer_bytes == built


def test_auto_num_moe_layers() -> None:
    fp = Footprint(fixed_bytes=100, moe_layer_bytes=40, kv_layer_bytes=10, fixed_kv_layers=2)
    # 1000 free - 200 reserve - (100 + 2 * 10) fixed = 680 room; 50 per MoE layer -> 13
    assert auto_num_moe_layers(1000, fp, 200) == 13
    assert auto_num_moe_layers(10**12, fp, 0) == 58
    with pytest.raises(ValueError, match="at least .* GB with one MoE layer"):
        auto_num_moe_layers(150, fp, 0)


def test_context_batches_own_page_aligned_slots() -> None:
    assert seq_stride(20, 4, 16) == 32
    assert kv_tokens_needed([1, 3], 20, 4, 16) == 96
    batch = context_batch(3, 20, 4, 16, 1000, torch.device("cpu"))
    assert batch.is_decode and batch.num_tokens == 12
    assert batch.kv_indptr == [0, 24, 48, 72]
    assert batch.kv_slots[24].item() == 32  # sequence 1 starts on its own page
    assert batch.positions[:4].tolist() == [20, 21, 22, 23]


def test_a_failing_point_is_recorded_and_the_run_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def fails() -> dict[str, Any]:
        raise RuntimeError("backend rejected the shape")

    row = guarded({"batch_size": 4}, fails)
    assert row == {"batch_size": 4, "error": "RuntimeError: backend rejected the shape"}
    assert guarded({"batch_size": 1}, lambda: {"ms": 2.0}) == {"batch_size": 1, "ms": 2.0}
    assert '"batch_size": 1, "ms": 2.0' in capsys.readouterr().out  # progress line


@pytest.mark.parametrize("flag", ["--attention-backend", "--moe-backend"])
def test_backend_names_reach_the_runner(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = [*TINY_RUN, "--no-mtp", "--prefill-lens", "--decode-batch-sizes", "1"]
    assert main([*args, flag, "no-such-backend", "--out", "/dev/null"]) == 2
    assert "'no-such-backend' unknown; supported: [" in capsys.readouterr().err


def test_cli_lists_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "model", "--help"])
    out = capsys.readouterr().out
    assert "--num-moe-layers" in out and "--attention-backend" in out


def test_json_written_where_asked(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    args = [*TINY_RUN, "--no-mtp", "--prefill-lens", "--decode-batch-sizes", "2"]
    assert main([*args, "--decode-contexts", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["mtp"] is None and result["prefill"] == []
    assert [r["batch_size"] for r in result["decode"]] == [2]


def test_build_retries_with_one_moe_layer_fewer_on_oom() -> None:
    tried: list[int] = []

    def fake_make_fits_two(n: int) -> Any:  # stands in for a GPU that holds 2 MoE layers
        tried.append(n)
        if n > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return f"runner with {n}"

    assert build_fitting_runner(fake_make_fits_two, 4, shrink_on_oom=True) == "runner with 2"
    assert tried == [4, 3, 2]
    with pytest.raises(torch.cuda.OutOfMemoryError):  # an explicit --num-moe-layers is kept
        build_fitting_runner(fake_make_fits_two, 3, shrink_on_oom=False)


# ---- GPU: flashinfer + Triton MoE on the tiny width with DeepSeek-V3's attention shapes ----
GPU_ATTENTION = DEEPSEEK_ATTENTION
GPU_CONTEXT = 100


@pytest.fixture(scope="module")
def gpu_runner() -> ModelRunner:
    """1 dense + 2 MoE layers + NextN, dummy FP8 weights, KV filled with random latents."""
    pytest.importorskip("flashinfer")
    raw = {**BENCH_PRESETS["tiny"], **GPU_ATTENTION, "num_hidden_layers": 3,
           "first_k_dense_replace": 1, "num_nextn_predict_layers": 1}  # fmt: skip
    kv = {"page_size": 64, "num_kv_tokens": 64 * 64, "kv_cache_dtype": "auto"}
    runner = build_runner(ModelConfig.from_dict(raw), "cuda", "flashinfer", "triton", kv)
    fill_kv_random(runner.pool)
    return runner


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("tokens", [1, 3])
def test_layer_graph_replays_the_eager_layer(
    gpu_runner: ModelRunner, layer: int, tokens: int
) -> None:
    timer = LayerGraphTimer(gpu_runner, GPU_CONTEXT, warmup=1, iters=3)
    graph = timer.capture(layer, 4, tokens)
    got = graph.replay().clone()
    want = graph.eager()
    assert got.shape == (4 * tokens, gpu_runner.model_cfg.hidden_size)
    scale = want.float().abs().max()
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02 * scale)
    assert _positive(timer.layer_ms(layer, 4, tokens))


@pytest.mark.gpu
def test_graphed_mtp_costs_projected_to_61_layers(gpu_runner: ModelRunner) -> None:
    plan = Plan([], [2], [GPU_CONTEXT], [2], GPU_CONTEXT, [1, 2], warmup=1, iters=3)
    bench = ModelBench(gpu_runner, plan, copy_TBps=3.0)
    row = {"batch_size": 2, **bench.spec_costs(2, bench.decode(2, GPU_CONTEXT))}
    g = row["graph"]
    assert g is not None and "layer_error" not in g
    t, p = g["layer_ms"], g["projected_61"]
    assert set(t["dense"]) == set(t["moe"]) == {"1", "2", "3"}
    # 1 dense + 2 MoE measured: DeepSeek-V3 has 2 dense and 56 MoE layers more
    assert p["decode_ms"] == pytest.approx(
        g["decode_ms"] + 56 * t["moe"]["1"] + 2 * t["dense"]["1"]
    )
    for k in ("1", "2"):
        w = str(int(k) + 1)
        want = g["verify_ms"][k] + 56 * t["moe"][w] + 2 * t["dense"][w]
        assert p["verify_ms"][k] == pytest.approx(want)
    summary = spec_summary([row], GPU_CONTEXT, [1, 2])
    assert [r["num_steps"] for r in summary["speedup_graph_61"]] == [1, 2]
    assert summary["speedup_graph_61"][1]["round_ms"] == pytest.approx(
        g["chain_ms"]["2"] + g["extend_ms"]["2"] + p["verify_ms"]["2"]
    )


@pytest.mark.gpu
def test_profile_graphs_lists_the_device_ops(gpu_runner: ModelRunner) -> None:
    profile = profile_graphs(gpu_runner, GPU_CONTEXT, warmup=1, iters=3)
    for key in ("decode", "draft_step"):
        p = profile[key]
        assert _positive(p["wall_ms"]) and _positive(p["kernel_ms"]) and p["top"]
        assert sum(op["ms"] for op in p["top"]) <= p["kernel_ms"] * (1 + 1e-9)
        assert p["span_ms"] is not None and p["span_ms"] >= 0.5 * p["kernel_ms"]
