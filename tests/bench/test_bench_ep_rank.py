"""The one-GPU EP-rank bench on CPU at tiny size, its loopback parts and its arithmetic.

References not written by the code under test: the memory planner's per-rank bytes for the
shard sizes (full DeepSeek-V3 built on the meta device, nothing allocated), hand-counted
routing for the experts hit, and meta tensors for "no host sync" (reading a meta tensor's
values on the host raises, as a sync would break CUDA-graph capture).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dsv3serve.bench.ep_rank.bytes import local_hits
from dsv3serve.bench.ep_rank.run import add_args, run_ep_rank
from dsv3serve.bench.ep_rank.setup import (
    LOOPBACK_LABEL,
    choose_kv,
    ep_model_config,
    ep_parallel,
    fit_context,
    kv_token_bytes,
    loopback_parts,
    planned_rank,
)
from dsv3serve.bench.model.batches import seq_stride
from dsv3serve.engine.group.rank_parts import RankParts
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions
from dsv3serve.parallel.comm_loopback import LoopbackTimingOnlyComm
from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.dispatch_loopback import LoopbackTimingOnlyDispatcher
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.plan.planner import GB

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(tmp_path: Path, layout: str, rank: int) -> argparse.Namespace:
    argv = [
        "--preset", "tiny", "--device", "cpu", "--layout", layout, "--rank", str(rank),
        "--batch-sizes", "1", "3", "--context", "20", "--page-size", "16",
        "--warmup", "1", "--iters", "1", "--eager-iters", "1",
        "--out", str(tmp_path / f"{layout}.json"),
    ]  # fmt: skip
    return add_args(argparse.ArgumentParser()).parse_args(argv)


@pytest.mark.parametrize(("layout", "rank"), [("ep2", 0), ("ep4", 3)])
def test_cpu_run_writes_every_field(tmp_path: Path, layout: str, rank: int) -> None:
    run_ep_rank(_args(tmp_path, layout, rank))
    result = json.loads((tmp_path / f"{layout}.json").read_text())
    assert result["label"] == LOOPBACK_LABEL and result["ceilings"]["copy_TBps"] > 0
    cfg = result["config"]
    n = int(layout[2:])
    assert cfg["rank"] == rank and cfg["local_experts"] == [rank * 16 // n, (rank + 1) * 16 // n]
    assert cfg["lm_head"].startswith("whole") and cfg["cuda_graph"] is False
    mem = result["memory"]
    assert mem["planner_weights_GB"] > 0 and mem["kv_cache_GB"] > 0
    rows = result["decode"]
    assert [(r["batch_size"], r["context"]) for r in rows] == [(1, 20), (3, 20)]
    for r in rows:
        assert "error" not in r, r
        assert r["label"] == LOOPBACK_LABEL and r["timed"].startswith("eager")
        assert r["ms"] > 0 and r["roofline_ms"] > 0
        assert r["ratio"] == pytest.approx(r["ms"] / r["roofline_ms"])
        assert r["total_bytes"] == pytest.approx(sum(r["bytes"].values()))
        assert 0 <= r["local_experts_hit"]["max"] <= 16 // n


@pytest.mark.parametrize(("preset", "ranks"), [("tiny", 2), ("tiny", 4), ("full", 8), ("full", 16)])
def test_loopback_shard_holds_exactly_the_planners_rank_bytes(preset: str, ranks: int) -> None:
    cfg = ep_model_config(preset)
    layout = RankLayout(ep_parallel(ranks), ranks - 1)
    parts, _ = loopback_parts(layout, cfg.n_routed_experts)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(
            cfg, ModelOptions(dtype=torch.bfloat16, layout=layout), parts.comm, parts.dispatcher
        )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = planned_rank(cfg, layout)
    assert params == planned.weights_total  # absorbed MLA is derived later, listed apart
    if preset == "full":  # the numbers: ~100 GB (EP8), ~60 GB (EP16) without NextN
        expected = {8: 100.8, 16: 60.0}[ranks]
        assert params / GB == pytest.approx(expected, abs=0.1)
        assert planned.absorbed_mla_bytes == 61 * 128 * 256 * 512 * 2


def test_loopback_comm_shapes() -> None:
    comm = LoopbackTimingOnlyComm(4, 2)
    x = torch.arange(6.0).view(3, 2)
    assert comm.all_reduce(x) is x
    assert comm.all_gather(x, -1).shape == (3, 8)
    rows, counts = comm.all_gather_rows(x)
    assert rows.shape == (12, 2) and counts == [3, 3, 3, 3]
    torch.testing.assert_close(rows[6:9], x)
    with pytest.raises(ValueError, match="0 <= rank < world_size, got world_size 2, rank 2"):
        LoopbackTimingOnlyComm(2, 2)


def test_loopback_dispatch_has_no_host_sync_and_static_rows() -> None:
    d = LoopbackTimingOnlyDispatcher(16, 4, 1)
    with torch.device("meta"):  # any host read of a value raises on meta tensors
        x = torch.empty(5, 160, dtype=torch.bfloat16)
        ids = torch.empty(5, 4, dtype=torch.int64)
        got = d.dispatch(x, ids, torch.empty(5, 4))
        out = d.combine(got.x, got)
    assert got.x.shape == (5, 160) and got.topk_ids.shape == (5, 4)
    assert out.shape == (5, 160)


def test_parts_keep_graphs_only_when_graph_safe() -> None:
    layout = RankLayout(ep_parallel(4), 0)
    parts, recorder = loopback_parts(layout, 16)
    assert parts.graph_safe and recorder.graph_safe
    assert parts.check_layout(ep_parallel(4)) is parts
    with pytest.raises(LayoutError, match="expected rank parts for the engine's layout"):
        parts.check_layout(ParallelConfig())

    class GroupStandIn(LoopbackTimingOnlyComm):  # a real group cannot be captured yet
        graph_safe = False

    assert not RankParts(layout, GroupStandIn(4, 0), recorder).graph_safe


def test_local_hits_counts_by_hand() -> None:
    experts = range(4, 8)  # rank 1 of 4, 16 experts
    ids = [torch.tensor([[4, 5, 0, 9], [5, 7, 12, 1]]), torch.tensor([[4, 5, 6, 7]])]
    assert local_hits(ids, experts) == [3, 4]  # {4, 5, 7}; {4, 5, 6, 7}
    assert local_hits([torch.tensor([[5, 0, 1, 2]])], experts) == [1]


def test_kv_choice_picks_bf16_then_fp8_then_caps() -> None:
    cfg = ep_model_config("full")
    bf16, fp8 = (kv_token_bytes(cfg, k, torch.bfloat16) for k in ("auto", "fp8_e4m3"))
    assert (bf16, fp8) == (61 * 1152, 61 * (576 + 4))
    need = 128 * seq_stride(4096, 1, 64)

    def pick(room: int) -> Any:
        return choose_kv(cfg, [1, 32, 128], 4096, 64, room, "pick", torch.bfloat16)

    assert pick(need * bf16).kv_cache_dtype == "auto"
    got = pick(need * bf16 - 1)
    assert got.kv_cache_dtype == "fp8_e4m3" and got.kv_tokens == need and not got.capped
    got = pick(need * fp8 // 2)
    assert got.kv_cache_dtype == "fp8_e4m3" and got.capped == [128]
    assert got.contexts[1] == got.contexts[32] == 4096 and got.contexts[128] == 2047
    assert got.kv_tokens * fp8 <= need * fp8 // 2
    with pytest.raises(ValueError, match="expected room for 128 sequences of at least 64"):
        pick(128 * 64 * fp8 - 1)


def test_fit_context_is_the_longest_that_fits() -> None:
    assert fit_context(2, 100, 16, 10_000) == 100
    c = fit_context(4, 4096, 64, 4 * 1000)
    assert c == 959 and 4 * seq_stride(c, 1, 64) <= 4000 < 4 * seq_stride(c + 64, 1, 64)
