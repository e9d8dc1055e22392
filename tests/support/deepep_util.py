"""Multi-rank runs of the DeepEP backend over ``fake_deep_ep`` (spawned gloo processes).

Each rank runs every case through the all-to-all backend and through the DeepEP glue in
each mode (normal flat path, low-latency masked path, ``auto`` for a prefill and a decode
batch), with the toy experts of :mod:`dispatch_util` (``rows @ mats[e]``), and saves what
came back; the test compares all of them with the single-rank reference. The spawned ranks
also record the refusals (self-check on a corrupt fake, too many tokens, wrong dtype).
"""

from __future__ import annotations

from pathlib import Path

import fake_deep_ep
import torch
from dispatch_util import (
    NUM_EXPERTS,
    Case,
    flat_round,
    gloo_rank,
    save_rank_results,
    spawn_for_results,
)

from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.ref import TorchRefMoE
from dsv3serve.moe.sharded import run_dispatched
from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.dispatch import DeepEPOptions, create_dispatcher
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher
from dsv3serve.parallel.dispatch_deepep import DeepEPDispatcher

MAX_TOKENS = 16  # low-latency max_tokens_per_rank of every case
MOE_HIDDEN, MOE_INTER = 128, 64


def deepep_config(world: int, mode: str) -> ParallelConfig:
    """DP attention + EP over ``world`` ranks with the DeepEP backend in ``mode``."""
    return ParallelConfig(
        tp_size=world, dp_size=world, enable_dp_attention=True, ep_size=world,
        moe_a2a_backend="deepep", deepep_mode=mode,
    )  # fmt: skip


def make_deepep(
    world: int,
    rank: int,
    mode: str,
    hidden: int,
    fp8: bool = False,
    corrupt: bool = False,
    max_tokens: int = MAX_TOKENS,
    metered: bool = True,
) -> DeepEPDispatcher:
    """The factory's DeepEP dispatcher over the fake (runs the self-check)."""
    opts = DeepEPOptions(hidden, max_tokens, fp8, module=fake_deep_ep.make_module(corrupt))
    config = deepep_config(world, mode)
    return create_dispatcher(config, NUM_EXPERTS, rank, deepep=opts, metered=metered)


def _flat(d, case: Case, rank: int) -> torch.Tensor:  # noqa: ANN001
    return flat_round(d, case, rank)[0]


def _masked(d: DeepEPDispatcher, case: Case, rank: int) -> torch.Tensor:
    got = d.dispatch_masked(case.xs[rank], case.ids[rank], case.weights[rank])
    assert got.x.shape == (d.num_local_experts, MAX_TOKENS * d.world, got.x.shape[2])
    first = rank * d.num_local_experts
    mats = case.mats[first : first + d.num_local_experts]
    rows = got.rows(torch.float32)
    y = torch.bmm(torch.nan_to_num(rows, nan=0.0), mats)  # padding rows: garbage
    y[torch.isnan(rows).any(-1)] = float("nan")  # keep padding poisoned for the combine
    return d.combine_masked(y.to(torch.bfloat16), got)


def _run_case(case: Case, world: int, rank: int) -> dict[str, torch.Tensor]:
    fp8 = case.payload_dtype is not None
    hidden = case.xs[rank].shape[1]
    out = {"a2a": _flat(AllToAllDispatcher(NUM_EXPERTS), case, rank)}
    out["normal"] = _flat(make_deepep(world, rank, "normal", hidden, fp8), case, rank)
    out["low_latency"] = _masked(make_deepep(world, rank, "low_latency", hidden, fp8), case, rank)
    auto = make_deepep(world, rank, "auto", hidden, fp8)
    out["auto_prefill"] = _flat(auto, case, rank)
    auto.prepare_graph()  # what the runner does before a graph replay: the clean happens here
    out["auto_cleans_before_decode"] = torch.tensor(auto.buffer.cleans)
    out["auto_decode"] = _masked(auto, case, rank)
    out["auto_cleans"] = torch.tensor(auto.buffer.cleans)
    return out


def _moe_round(world: int, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """``run_dispatched`` with real experts (TorchRefMoE flat, masked MoE decode) vs one rank."""
    torch.manual_seed(seed)
    ex = random_experts(NUM_EXPERTS, MOE_HIDDEN, MOE_INTER, False, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(t, MOE_HIDDEN, generator=g).bfloat16() for t in (9, 5)]
    ids = [torch.rand(x.shape[0], NUM_EXPERTS, generator=g).topk(4, 1).indices for x in xs]
    ws = [torch.rand(x.shape[0], 4, generator=g) for x in xs]
    n = NUM_EXPERTS // world
    mine = random_experts(n, MOE_HIDDEN, MOE_INTER, False, torch.bfloat16, "cpu")
    mine.w13.data.copy_(ex.w13[rank * n : (rank + 1) * n])
    mine.w2.data.copy_(ex.w2[rank * n : (rank + 1) * n])
    d = make_deepep(world, rank, "auto", MOE_HIDDEN)
    args = (TorchRefMoE(), xs[rank], ws[rank], ids[rank], mine)
    return {
        "prefill": run_dispatched(d, *args, decode=False),
        "decode": run_dispatched(d, *args, decode=True),
        "want": TorchRefMoE().forward(xs[rank], ws[rank], ids[rank], ex),
    }


def _refusal(fn) -> str:  # noqa: ANN001
    try:
        fn()
    except (LayoutError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _refusals(world: int, rank: int) -> dict[str, str]:
    x = torch.zeros(MAX_TOKENS + 1, 128, dtype=torch.bfloat16)
    ids = torch.zeros(MAX_TOKENS + 1, 2, dtype=torch.int64)
    w = torch.ones(MAX_TOKENS + 1, 2)
    ll = make_deepep(world, rank, "low_latency", 128)
    normal = make_deepep(world, rank, "normal", 128)
    return {
        "corrupt_normal": _refusal(lambda: make_deepep(world, rank, "normal", 128, corrupt=True)),
        "corrupt_ll": _refusal(lambda: make_deepep(world, rank, "low_latency", 128, corrupt=True)),
        "too_many": _refusal(lambda: ll.dispatch_masked(x, ids, w)),
        "qp_depth": _refusal(lambda: make_deepep(world, rank, "auto", 128, max_tokens=512)),
        "fp32": _refusal(lambda: normal.dispatch(x.float(), ids, w)),
        "flat_under_ll": _refusal(lambda: ll.dispatch(x, ids, w)),
        "masked_under_normal": _refusal(lambda: normal.dispatch_masked(x[:2], ids[:2], w[:2])),
    }


def _close(world: int, rank: int) -> dict[str, bool]:
    """A dispatcher's close on every rank: the buffer was made to be released explicitly,
    and close releases it once (a second close is a no-op)."""
    d = make_deepep(world, rank, "auto", 128)
    buffer = d.buffer
    d.close()
    d.close()
    return {"explicit": buffer.explicitly_destroy, "destroyed": buffer.destroyed}


def _rank_main(rank: int, world: int, workdir: str, seed: int) -> None:
    with gloo_rank(rank, world, workdir) as root:
        cases: list[Case] = torch.load(root / "cases.pt", weights_only=False)
        results: dict = {c.name: _run_case(c, world, rank) for c in cases}
        results["_close"] = _close(world, rank)
        results["_moe"] = _moe_round(world, rank, seed)
        results["_refusals"] = _refusals(world, rank)
        save_rank_results(results, root, rank)


def run_deepep_ranks(cases: list[Case], world: int, workdir: Path, seed: int) -> list[dict]:
    """Every case on ``world`` spawned gloo ranks; returns each rank's results dict."""
    torch.save(cases, workdir / "cases.pt")
    return spawn_for_results(_rank_main, (world, str(workdir), seed), world, workdir)
