"""The all-gather dispatcher (graphed DP-attention decode) and the uniform-batch collectives
on real spawned gloo ranks, against the single-rank reference over all experts.

Inputs are random with a fresh seed (printed on failure). Each rank computes, from the same
seed, every rank's tokens, so it can check its own output against the reference alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dispatch_util import HIDDEN, NUM_EXPERTS, TOPK, experts_fn, random_ids
from fresh_seed import session_seed
from shard_util import run_ranks

from dsv3serve.parallel.comm import GroupComm, make_comm
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher
from dsv3serve.parallel.dispatch_gather import UniformGatherDispatcher, pack_rows, unpack_rows
from dsv3serve.parallel.dispatch_ref import local_experts, moe_reference
from dsv3serve.parallel.uniform import uniform_batch, uniform_rows

SEED = session_seed()
WORLD = 2
# name -> (rows per rank inside the uniform batch, the experts every token picks from)
UNIFORM_CASES = {
    "spread": (6, range(NUM_EXPERTS)),
    "all_to_rank0": (5, range(0, NUM_EXPERTS // 2)),  # rank 1's experts get nothing
    "all_to_rank1": (3, range(NUM_EXPERTS // 2, NUM_EXPERTS)),
    "one_row": (1, range(NUM_EXPERTS)),
}
EAGER_ROWS = [7, 0]  # outside a uniform batch: unequal ranks, one empty


def _inputs(name: str, rank: int, rows: int, experts: range) -> tuple[torch.Tensor, ...]:
    offset = 1 + 10 * [*UNIFORM_CASES, "eager"].index(name) + rank  # str hashes vary by process
    gen = torch.Generator().manual_seed(SEED + offset)
    x = torch.randn(rows, HIDDEN, generator=gen)
    ids = random_ids(gen, rows, experts)
    ids[:, -1] = -1 if rows else ids[:, -1]  # one empty slot per token: skipped everywhere
    return x, ids, torch.rand(rows, TOPK, generator=gen)


def _mats() -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    return torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5


def _round(d: UniformGatherDispatcher, rank: int, x: torch.Tensor, *routing: torch.Tensor):
    sent = d.dispatch(x, *routing)
    mine = local_experts(experts_fn(_mats()), rank * d.num_local_experts)
    return d.combine(moe_reference(sent.x, sent.topk_ids, sent.topk_weights, mine), sent), sent


def gather_worker(rank: int, out: str, seed: int) -> None:
    global SEED
    SEED = seed  # a spawned rank imports this module afresh: use the test's seed
    comm = make_comm()
    assert isinstance(comm, GroupComm)
    d = UniformGatherDispatcher(AllToAllDispatcher(NUM_EXPERTS), comm)
    results: dict[str, object] = {}
    for name, (rows, experts) in UNIFORM_CASES.items():
        x, ids, w = _inputs(name, rank, rows, experts)
        with uniform_batch(rows):
            got, sent = _round(d, rank, x, ids, w)
        results[name] = (got, sent.x.shape[0])
    x, ids, w = _inputs("eager", rank, EAGER_ROWS[rank], range(NUM_EXPERTS))
    got, sent = _round(d, rank, x, ids, w)  # no uniform batch: the all-to-all
    results["eager"] = (got, sent.x.shape[0])
    with uniform_batch(4):
        rows, counts = comm.all_gather_rows(torch.full((4, 2), float(rank)))
        try:
            comm.all_gather_rows(torch.zeros(3, 2))
            results["mismatch"] = "no error"
        except ValueError as e:
            results["mismatch"] = str(e)
    results["rows"], results["counts"] = rows, counts
    block = torch.arange(4 * WORLD, dtype=torch.float32)[:, None] * (rank + 1)
    results["reduce_scatter"] = comm.reduce_scatter_rows(block)
    torch.save(results, f"{out}/{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("gather")
    run_ranks(WORLD, gather_worker, str(out), SEED)
    return [torch.load(Path(out) / f"{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", [*UNIFORM_CASES, "eager"])
def test_gather_dispatch_equals_the_reference(name: str, ranks: list[dict]) -> None:
    for rank in range(WORLD):
        if name == "eager":
            rows, experts = EAGER_ROWS[rank], range(NUM_EXPERTS)
        else:
            rows, experts = UNIFORM_CASES[name]
        x, ids, w = _inputs(name, rank, rows, experts)
        want = moe_reference(x, ids, w, experts_fn(_mats()))
        got, received = ranks[rank][name]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"seed {SEED} rank {rank}"
        if name != "eager":  # the uniform path gathers every rank's rows
            assert received == rows * WORLD


def test_uniform_collectives(ranks: list[dict]) -> None:
    for rank in range(WORLD):
        got = ranks[rank]
        assert got["counts"] == [4, 4]  # the agreed count: nothing exchanged
        want = torch.cat([torch.full((4, 2), 0.0), torch.full((4, 2), 1.0)])
        assert torch.equal(got["rows"], want)
        assert "expected 4 rows in a uniform batch, got 3" in got["mismatch"]
        total = torch.arange(4 * WORLD, dtype=torch.float32)[:, None] * 3  # (1 + 2) * row
        assert torch.equal(got["reduce_scatter"], total[rank * 4 : (rank + 1) * 4])


def test_uniform_batch_is_scoped() -> None:
    assert uniform_rows() is None
    with uniform_batch(8):
        assert uniform_rows() == 8
        with uniform_batch(2):
            assert uniform_rows() == 2
        assert uniform_rows() == 8
    assert uniform_rows() is None
    with pytest.raises(ValueError, match="at least 1 row"), uniform_batch(0):
        pass


@pytest.mark.parametrize("tokens", [0, 5])
def test_packed_rows_round_trip_over_a_gather(tokens: int) -> None:
    """The uniform dispatch sends hidden rows, ids and weights as one byte row per token;
    unpacking the gathered rows of two ranks gives back each rank's exact values."""

    def one() -> tuple[torch.Tensor, ...]:
        x = torch.randn(tokens, 24).bfloat16()
        return x, torch.randint(-1, 16, (tokens, 4)), torch.rand(tokens, 4)

    ranks = [one(), one()]
    gathered = torch.cat([pack_rows(*r) for r in ranks])
    assert gathered.dtype == torch.uint8 and gathered.shape == (2 * tokens, 24 * 2 + 12 * 4)
    xs, ids, weights = unpack_rows(gathered, ranks[0][0], 4)
    for got, part in zip((xs, ids, weights), zip(*ranks, strict=True), strict=True):
        torch.testing.assert_close(got, torch.cat(part), rtol=0, atol=0)
