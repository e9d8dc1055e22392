"""The tuner's search space (the timing itself needs a GPU:
``dsv3serve.bench.kernels.moe_tune``)."""

from __future__ import annotations

import json

import pytest
import torch

from dsv3serve.bench.kernels.moe_tune import (
    BLOCK_MS,
    QUICK_TOKENS,
    block_ms,
    build_parser,
    local_experts,
    main,
    routing_ids,
    tiles,
    tune_table,
    write_table,
)
from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.gate import grouped_topk
from dsv3serve.moe.moe_config import MoEConfig, default_config


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("fp8", [True, False])
def test_candidates_respect_the_kernel_contract(block_m: int, fp8: bool) -> None:
    gate_up, down = tiles(True, fp8, block_m), tiles(False, fp8, block_m)
    assert gate_up and down
    for t in gate_up + down:
        assert t.block_k == (128 if fp8 else 64)
        assert not t.swap_ab or block_m <= 64
    if fp8:  # one program quantises one 128-wide group of the intermediate
        assert {t.block_n for t in gate_up} == {128}


def test_refuses_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA"):
        main(["--tokens", "1"])


@pytest.mark.parametrize("block_m", BLOCK_MS)
def test_quick_candidates_are_a_subset(block_m: int) -> None:
    quick, full = tiles(True, True, block_m, quick=True), tiles(True, True, block_m)
    assert quick and set(quick) < set(full)
    assert set(tiles(False, True, block_m, quick=True)) < set(tiles(False, True, block_m))


def test_quick_block_sizes_follow_rows_per_expert() -> None:
    assert block_ms(1, 256, 8, quick=False) == BLOCK_MS
    assert block_ms(1, 257, 9, quick=True) == (16, 32)
    assert block_ms(1024, 256, 8, quick=True) == (16, 32, 64)  # 32 rows per expert
    assert block_ms(4096, 256, 8, quick=True) == (32, 64, 128)


def test_spent_budget_writes_the_default_rule() -> None:
    """Past the budget no GPU is touched: the remaining token counts get default_config."""
    ex = random_experts(16, 256, 128, True, torch.bfloat16, "cpu", shared_slots=1)
    args = build_parser().parse_args(["--quick", "--budget-s", "-1"])
    table = tune_table(ex, args)
    assert list(table) == [str(t) for t in QUICK_TOKENS]
    for t, cfg in table.items():  # the E + 1 stack, top_k + 1 assignments per token
        assert MoEConfig.from_json(cfg) == default_config(int(t), 17, 9, True)


def test_merge_keeps_other_token_counts(tmp_path) -> None:
    path = tmp_path / "t.json"
    one = {t: default_config(t, 256, 8, True).to_json() for t in (1, 4096)}
    write_table(path, {"4096": one[4096]}, merge=False)
    write_table(path, {"1": one[1]}, merge=True)
    assert list(json.loads(path.read_text())) == ["1", "4096"]
    write_table(path, {"1": one[1]}, merge=False)
    assert list(json.loads(path.read_text())) == ["1"]


def _ep_args(*extra: str):
    return build_parser().parse_args(
        ["--experts", "32", "--hidden", "256", "--inter", "128", "--n-group", "8", *extra]
    )


def test_ep_rank_routing_keeps_its_own_experts_and_drops_the_rest() -> None:
    """Under --ep-size 2 the stack is rank 0's 16 experts: the router still chooses over all
    32, and a choice of experts 16-31 arrives as -1 (as the dispatchers deliver it)."""
    args = _ep_args("--ep-size", "2")
    ex = random_experts(local_experts(args), 256, 128, True, torch.bfloat16, "cpu")
    torch.manual_seed(3)
    ids = routing_ids(64, ex, args)
    torch.manual_seed(3)
    logits, bias = torch.randn(64, 32), torch.randn(32) * 0.1
    _, chosen = grouped_topk(logits, bias, 8, 8, 4, 2.5)
    assert ids.shape == (64, 8)
    assert torch.equal(ids, torch.where(chosen < 16, chosen, -1))
    assert 0 < int((ids >= 0).sum()) < ids.numel()  # both kinds occur


def test_ep_size_must_divide_the_experts_and_excludes_shared_fusion() -> None:
    assert local_experts(_ep_args("--ep-size", "4")) == 8
    with pytest.raises(SystemExit, match="does not divide"):
        local_experts(_ep_args("--ep-size", "3"))
    with pytest.raises(SystemExit, match="not fused"):
        local_experts(_ep_args("--ep-size", "2", "--shared"))
