"""Expert-parallel dispatch / combine against the single-rank reference.

Multi-rank cases run on real spawned processes over gloo (2 ranks, and 4 for two cases); the
reference is ``dispatch_ref.moe_reference`` over all experts on the unsplit tokens, which
the dispatch code does not use. Inputs are random with a fresh seed per session (printed in
the failure message).

Tolerances: fp32 hidden: 1e-5 (only the order of float32 additions differs). bf16 hidden:
atol = rtol = 1e-2; each rank's part of a token is rounded to bf16 before combine and the
sum once more after it (each at most 2^-9 relative), against a float32 reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dispatch_util import HIDDEN, NUM_EXPERTS, TOPK, Case, experts_fn, make_case, run_ranks
from fresh_seed import session_seed

from dsv3serve.kernels.fp8_ref import FP8_DTYPE, dequant_per_token_group, quant_per_token_group
from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.dispatch import create_dispatcher
from dsv3serve.parallel.dispatch_loopback import LoopbackTimingOnlyDispatcher, NoDispatch
from dsv3serve.parallel.dispatch_pack import WireFormat, copy_mask, plan_routes
from dsv3serve.parallel.dispatch_ref import local_experts, moe_reference, restrict_to_rank

SEED = session_seed()
BF16 = torch.bfloat16
F32 = torch.float32


def _gen(offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """bf16: each expert's output is rounded to bf16 (a 2^-8 relative half-ulp of values up to
    ~4 here) before the weighted sum, so where the sum cancels the error follows the summands,
    not the result (atol 1e-2 failed on one fresh seed in CI: 0.0118 at a result of 0.09).
    A wrong or missing expert contribution is off by about |y| ~ 1."""
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == F32 else {"atol": 3e-2, "rtol": 1e-2}


def _two_rank_cases() -> list[Case]:
    g = _gen()
    return [
        make_case("uniform_fp32", g, [13, 9], F32),
        make_case("uniform_bf16", g, [11, 16], BF16),
        make_case("skewed_to_rank0_fp32", g, [8, 5], F32, experts=range(0, 8)),
        make_case("skewed_to_rank1_bf16", g, [6, 9], BF16, experts=range(8, 16)),
        make_case("rank1_empty_bf16", g, [10, 0], BF16),
        make_case("rank0_empty_fp32", g, [0, 7], F32),
        make_case("all_empty_fp32", g, [0, 0], F32),
        make_case("all_empty_bf16", g, [0, 0], BF16),
        make_case("fp8_payload_bf16", g, [12, 7], BF16, payload_dtype=FP8_DTYPE),
        make_case("fp8_payload_rank0_empty", g, [0, 5], BF16, payload_dtype=FP8_DTYPE),
    ]


def _four_rank_cases() -> list[Case]:
    g = _gen(1)
    return [
        make_case("uniform_bf16", g, [9, 4, 0, 12], BF16),
        make_case("skewed_to_rank2_fp32", g, [5, 7, 3, 6], F32, experts=range(8, 12)),
    ]


@pytest.fixture(scope="module")
def two_ranks_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Case], list[str]]:
    return run_ranks(_two_rank_cases(), 2, tmp_path_factory.mktemp("a2a2"))


@pytest.fixture(scope="module")
def two_ranks(two_ranks_run: tuple[list[Case], list[str]]) -> dict[str, Case]:
    return {c.name: c for c in two_ranks_run[0]}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    cases, _ = run_ranks(_four_rank_cases(), 4, tmp_path_factory.mktemp("a2a4"))
    return {c.name: c for c in cases}


def _sent_input(case: Case, rank: int) -> torch.Tensor:
    """What the experts see of rank ``rank``'s tokens: fp8-rounded with an fp8 payload."""
    x = case.xs[rank]
    if case.payload_dtype is None or x.shape[0] == 0:
        return x
    return dequant_per_token_group(*quant_per_token_group(x)).to(x.dtype)


def _expected_received(case: Case, rank: int, per_rank: int) -> int:
    """Tokens (over all ranks) with at least one expert on ``rank``: one copy each."""
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    return sum(int(((ids >= lo) & (ids < hi)).any(1).sum()) for ids in case.ids)


def _check_case(case: Case) -> None:
    world = len(case.xs)
    fn = experts_fn(case.mats)
    for rank in range(world):
        x, out = case.xs[rank], case.outputs[rank]
        ref = moe_reference(_sent_input(case, rank), case.ids[rank], case.weights[rank], fn)
        assert out.dtype == x.dtype and out.shape == x.shape, (case.name, rank, SEED)
        where = f"{case.name} rank {rank} seed {SEED}"
        tol = _tol(x.dtype)
        torch.testing.assert_close(out.float(), ref, **tol, msg=lambda m, w=where: f"{w}: {m}")
        expected = _expected_received(case, rank, NUM_EXPERTS // world)
        assert case.received[rank] == expected, (case.name, rank, SEED)


@pytest.mark.parametrize("name", [c.name for c in _two_rank_cases()])
def test_two_ranks_equal_reference(two_ranks: dict[str, Case], name: str) -> None:
    _check_case(two_ranks[name])


@pytest.mark.parametrize("name", [c.name for c in _four_rank_cases()])
def test_four_ranks_equal_reference(four_ranks: dict[str, Case], name: str) -> None:
    _check_case(four_ranks[name])


def test_skewed_case_leaves_a_rank_without_rows(two_ranks: dict[str, Case]) -> None:
    """The skewed cases really exercise a rank that receives nothing."""
    assert two_ranks["skewed_to_rank0_fp32"].received[1] == 0
    assert two_ranks["skewed_to_rank1_bf16"].received[0] == 0


def test_fp8_payload_is_close_to_unquantised(two_ranks: dict[str, Case]) -> None:
    """fp8 e4m3 (3 mantissa bits) moves the output by a few percent of its scale, not more."""
    case = two_ranks["fp8_payload_bf16"]
    for rank in range(2):
        fn = experts_fn(case.mats)
        ref = moe_reference(case.xs[rank], case.ids[rank], case.weights[rank], fn)
        err = (case.outputs[rank].float() - ref).abs().max()
        assert err <= 0.1 * ref.abs().max(), (rank, float(err), SEED)


def _plan_by_loop(
    ids: torch.Tensor, weights: torch.Tensor, per_rank: int, world: int
) -> list[tuple[int, list[int], list[float]]]:
    """Plain per-token loop: the copies (rank, token, local ids, weights) in rank-major order."""
    rows: list[tuple[int, list[int], list[float]]] = []
    for rank in range(world):
        for t in range(ids.shape[0]):
            experts = [int(e) for e in ids[t]]
            here = [e >= 0 and e // per_rank == rank for e in experts]
            if any(here):
                local = [
                    e - rank * per_rank if h else -1 for e, h in zip(experts, here, strict=True)
                ]
                w = [float(v) if h else 0.0 for v, h in zip(weights[t], here, strict=True)]
                rows.append((t, local, w))
    return rows


@pytest.mark.parametrize("world", [2, 4])
def test_plan_matches_a_per_token_loop(world: int) -> None:
    g = _gen(2)
    ids = torch.rand(23, NUM_EXPERTS, generator=g).topk(TOPK, dim=1).indices
    ids[3, 1] = ids[17, 0] = -1  # slots with no expert
    weights = torch.rand(23, TOPK, generator=g)
    per_rank = NUM_EXPERTS // world
    mask = copy_mask(ids, per_rank, world)
    plan = plan_routes(ids, weights, per_rank, mask, int(mask.sum()))
    columns = (plan.src_token.tolist(), plan.local_ids.tolist(), plan.weights.tolist())
    got = list(zip(*columns, strict=True))
    assert got == _plan_by_loop(ids, weights, per_rank, world)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_wire_format_round_trip(dtype: torch.dtype) -> None:
    g = _gen(3)
    x = torch.randn(5, HIDDEN, generator=g).to(dtype)
    ids = torch.rand(5, NUM_EXPERTS, generator=g).topk(TOPK, dim=1).indices
    weights = torch.rand(5, TOPK, generator=g)
    mask = copy_mask(ids, 8, 2)
    plan = plan_routes(ids, weights, 8, mask, int(mask.sum()))
    wire = WireFormat(HIDDEN, TOPK, dtype)
    buf = wire.pack(x, plan)
    assert buf.dtype == torch.uint8 and buf.shape[1] % 16 == 0
    got_x, got_ids, got_w = wire.unpack(buf)
    assert torch.equal(got_x, x[plan.src_token])
    assert torch.equal(got_ids, plan.local_ids.long()) and torch.equal(got_w, plan.weights)


def test_no_dispatch_is_the_identity() -> None:
    g = _gen(4)
    x = torch.randn(6, HIDDEN, generator=g).to(BF16)
    ids = torch.rand(6, NUM_EXPERTS, generator=g).topk(TOPK, dim=1).indices.int()
    weights = torch.rand(6, TOPK, generator=g).to(BF16)
    d = NoDispatch(NUM_EXPERTS)
    got = d.dispatch(x, ids, weights)
    assert got.x is x and got.topk_ids.dtype == torch.int64 and got.topk_weights.dtype == F32
    assert torch.equal(got.topk_ids, ids.long()) and d.num_local_experts == NUM_EXPERTS
    y = torch.randn(6, HIDDEN, generator=g).to(BF16)
    assert d.combine(y, got) is y
    with pytest.raises(ValueError, match="expected y with 6 rows, got 5"):
        d.combine(y[:5], got)


@pytest.mark.parametrize("payload_dtype", [None, FP8_DTYPE])
@pytest.mark.parametrize("tokens", [0, 19])
def test_loopback_equals_reference_restricted_to_its_experts(
    tokens: int, payload_dtype: torch.dtype | None
) -> None:
    g = _gen(5)
    mats = torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    x = torch.randn(tokens, HIDDEN, generator=g).to(BF16)
    ids = torch.rand(tokens, NUM_EXPERTS, generator=g).topk(TOPK, dim=1).indices
    weights = torch.rand(tokens, TOPK, generator=g)
    sent = x if payload_dtype is None or tokens == 0 else _fp8_round(x)
    for rank in range(4):
        d = LoopbackTimingOnlyDispatcher(NUM_EXPERTS, 4, rank, payload_dtype=payload_dtype)
        got = d.dispatch(x, ids, weights)
        y = moe_reference(
            got.x, got.topk_ids, got.topk_weights, local_experts(experts_fn(mats), rank * 4)
        ).to(BF16)
        out = d.combine(y, got)
        ref = moe_reference(sent, restrict_to_rank(ids, 4, rank), weights, experts_fn(mats))
        torch.testing.assert_close(out.float(), ref, **_tol(BF16))


def _fp8_round(x: torch.Tensor) -> torch.Tensor:
    return dequant_per_token_group(*quant_per_token_group(x)).to(x.dtype)


def _dp_ep(world: int, **kw: str) -> ParallelConfig:
    return ParallelConfig(
        tp_size=world, dp_size=world, enable_dp_attention=True, ep_size=world, **kw
    )


def test_factory_picks_by_layout() -> None:
    assert isinstance(create_dispatcher(ParallelConfig(tp_size=2), NUM_EXPERTS, 1), NoDispatch)
    loop = create_dispatcher(_dp_ep(4), NUM_EXPERTS, 3, loopback=True)
    assert isinstance(loop, LoopbackTimingOnlyDispatcher) and loop.rank == 3
    assert loop.num_local_experts == 4
    with pytest.raises(LayoutError, match="needs an initialised torch.distributed"):
        create_dispatcher(_dp_ep(2), NUM_EXPERTS, 0)


def test_factory_refuses_a_group_that_is_not_the_ep_group(
    two_ranks_run: tuple[list[Case], list[str]],
) -> None:
    for rank, message in enumerate(two_ranks_run[1]):
        expected = f"expected an expert-parallel group of 4 ranks in which this is rank {rank}, "
        assert message == expected + f"found 2 ranks and rank {rank}"


def test_payload_dtype_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match=r"payload_dtype: expected one of .*, got torch.int8"):
        LoopbackTimingOnlyDispatcher(NUM_EXPERTS, 2, 0, payload_dtype=torch.int8)


def test_dispatch_refuses_mismatched_routing() -> None:
    d = NoDispatch(NUM_EXPERTS)
    with pytest.raises(ValueError, match=r"one routing row per token \(4\), got 3"):
        d.dispatch(torch.zeros(4, 8), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))


def test_docs_deepep_exists() -> None:
    assert (Path(__file__).resolve().parents[2] / "docs" / "deepep.md").is_file()
