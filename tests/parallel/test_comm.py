"""GroupComm's collectives on a real 2-process gloo group, against values each rank can
compute on its own; SingleRank's no-ops."""

from __future__ import annotations

from pathlib import Path

import torch
from shard_util import run_ranks

from dsv3serve.parallel.comm import GroupComm, SingleRank, make_comm


def _rank_rows(rank: int) -> torch.Tensor:
    """Rank 0 has 3 rows, rank 1 none: [n, 2] with values 10 * rank + row."""
    n = 3 if rank == 0 else 0
    return (10 * rank + torch.arange(n, dtype=torch.float32))[:, None].repeat(1, 2)


def comm_worker(rank: int, out: str) -> None:
    comm = make_comm()
    assert isinstance(comm, GroupComm) and (comm.rank, comm.world_size) == (rank, 2)
    summed = comm.all_reduce(torch.full((2,), float(rank + 1)))
    gathered = comm.all_gather(torch.full((1, 2), float(rank)), dim=1)
    rows, counts = comm.all_gather_rows(_rank_rows(rank))
    # block s (one row, 10 * rank + s) goes to rank s
    sent = (10 * rank + torch.arange(2, dtype=torch.float32))[:, None]
    result = {"sum": summed, "gather": gathered, "rows": rows, "counts": counts}
    result["a2a"] = comm.all_to_all_rows(sent)
    torch.save(result, f"{out}/{rank}.pt")


def test_group_comm_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(2, comm_worker, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got["sum"], torch.full((2,), 3.0))
        assert torch.equal(got["gather"], torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
        assert got["counts"] == [3, 0]
        want = torch.cat([_rank_rows(0), torch.zeros(3, 2)])  # rank 1's block is padding
        assert torch.equal(got["rows"], want)
        # block r came from rank r: its row for this rank, 10 * r + rank
        assert torch.equal(got["a2a"], torch.tensor([[0.0 + rank], [10.0 + rank]]))


def test_single_rank_is_identity() -> None:
    x = torch.randn(3, 4)
    comm = SingleRank()
    assert comm.all_reduce(x) is x and comm.all_gather(x, 1) is x
    rows, counts = comm.all_gather_rows(x)
    assert rows is x and counts == [3] and (comm.rank, comm.world_size) == (0, 1)
    assert comm.all_to_all_rows(x) is x
    assert isinstance(make_comm(), SingleRank)  # torch.distributed not initialised here
