"""The low-latency (masked) path of an EP group: DeepEP's fake over gloo ranks, every batch
masked (``low_latency``), with a per-rank bound smaller than the batches (a prefill step),
against the routed experts on one rank. Ranks hold different token counts, so the rank
that runs out joins the remaining rounds with a row routed nowhere: the round count comes
from the step's largest batch (``step_max_tokens``, the DP step header's), the same on
every rank. Also with FP8 dispatch and e4m3 experts (e4m3 rows into the masked MoE, which
quantise as the reference's activation quantisation does)."""

from __future__ import annotations

from pathlib import Path

import fake_deep_ep
import pytest
import torch
from shard_util import run_ranks

from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.ref import TorchRefMoE
from dsv3serve.moe.sharded import run_dispatched
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.dispatch import DeepEPOptions, create_dispatcher
from dsv3serve.parallel.dispatch_base import (
    Dispatched,
    Dispatcher,
    MaskedDispatched,
    MaskedDispatcher,
)
from dsv3serve.parallel.uniform import uniform_batch

EXPERTS, HIDDEN, INTER, TOP_K, BOUND = 16, 256, 128, 4, 4
TOKENS = (11, 3)  # rank 0 needs 3 rounds of BOUND, rank 1 one


def _worker(rank: int, world: int, fp8: bool, result_dir: str) -> None:
    torch.manual_seed(3)
    ex = random_experts(EXPERTS, HIDDEN, INTER, fp8, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=g).bfloat16()
    ids = torch.rand(x.shape[0], EXPERTS, generator=g).topk(TOP_K, 1).indices
    w = torch.rand(x.shape[0], TOP_K, generator=g)
    local = EXPERTS // world
    mine = random_experts(local, HIDDEN, INTER, fp8, torch.bfloat16, "cpu")
    held = slice(rank * local, (rank + 1) * local)
    for name in ("w13", "w2", "w13_scale_inv", "w2_scale_inv"):
        if getattr(ex, name) is not None:
            getattr(mine, name).data.copy_(getattr(ex, name)[held])
    parallel = ParallelConfig(
        tp_size=world, dp_size=world, enable_dp_attention=True, ep_size=world,
        moe_a2a_backend="deepep", deepep_mode="low_latency",
    )  # fmt: skip
    opts = DeepEPOptions(HIDDEN, BOUND, fp8_dispatch=fp8, module=fake_deep_ep.make_module())
    d = create_dispatcher(parallel, EXPERTS, rank, deepep=opts)
    d.step_max_tokens = max(TOKENS)
    got = run_dispatched(d, TorchRefMoE(), x, w, ids, mine, decode=False)
    # e4m3 experts quantise activations per 128 channels, as FP8 dispatch does
    want = TorchRefMoE().forward(x, w, ids, ex)
    torch.save({"got": got, "want": want}, Path(result_dir) / f"rank{rank}.pt")
    d.close()


@pytest.mark.parametrize("fp8", [False, True])
def test_masked_rounds_over_the_bound_match_one_rank(fp8: bool, tmp_path: Path) -> None:
    run_ranks(2, _worker, 2, fp8, str(tmp_path))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["got"].shape == (TOKENS[rank], HIDDEN)
        assert float(r["want"].float().abs().mean()) > 1e-3
        torch.testing.assert_close(r["got"].float(), r["want"].float(), atol=2e-3, rtol=3e-2)


class PaddingRecordingFake(Dispatcher, MaskedDispatcher):
    """FAKE one-rank masked dispatcher: nothing moves; records the ``num_tokens`` each
    masked dispatch got and returns an empty slab."""

    num_local_experts, max_tokens_per_rank = 2, 8

    def __init__(self) -> None:
        self.num_tokens: list[torch.Tensor | None] = []

    def use_masked(self, decode: bool) -> bool:
        return True

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor) -> Dispatched:
        raise AssertionError("masked only")

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        raise AssertionError("masked only")

    def dispatch_masked(self, x, ids, w, num_tokens=None) -> MaskedDispatched:  # noqa: ANN001
        self.num_tokens.append(num_tokens)
        slab = x.new_zeros(2, self.max_tokens_per_rank, x.shape[1])
        return MaskedDispatched(slab, torch.zeros(2, dtype=torch.int32), state=x.shape[0])

    def combine_masked(self, y: torch.Tensor, dispatched: MaskedDispatched) -> torch.Tensor:
        return y.new_zeros(dispatched.state, y.shape[2])


def test_a_graphs_padding_rows_are_routed_nowhere() -> None:
    """Inside a uniform batch (a replayed decode graph) the masked dispatch gets the device
    scalar of real tokens, so DeepEP sends none of the padding rows; outside, none."""
    d = PaddingRecordingFake()
    experts = random_experts(2, 256, 128, False, torch.bfloat16, "cpu")
    x, w, ids = (
        torch.zeros(4, 256).bfloat16(),
        torch.ones(4, 2),
        torch.zeros(4, 2, dtype=torch.long),
    )
    real = torch.tensor(3)
    with uniform_batch(4, real):
        run_dispatched(d, TorchRefMoE(), x, w, ids, experts, decode=True)
    run_dispatched(d, TorchRefMoE(), x, w, ids, experts, decode=True)
    assert d.num_tokens[0] is real and d.num_tokens[1] is None
