"""Multi-rank dispatch cases: inputs made in the test process, run by spawned gloo ranks.

The test process writes every case (each rank's tokens and routing, the experts' matrices)
to one file; :func:`run_ranks` spawns ``world`` processes that each dispatch their tokens,
apply their own experts to what arrived (local ids), combine, and save what came back. The
test then compares with the single-rank reference over all experts.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_procs import start_ranks

from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.dispatch import create_dispatcher
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher
from dsv3serve.parallel.dispatch_base import Dispatcher
from dsv3serve.parallel.dispatch_ref import ExpertsFn, local_experts, moe_reference

NUM_EXPERTS = 16
TOPK = 4
HIDDEN = 160  # two fp8 groups of 128 channels, the second one partial


@dataclass
class Case:
    """One dispatch -> experts -> combine round: per-rank ``xs`` [T_r, H], ``ids`` [T_r, K],
    ``weights`` [T_r, K]; ``mats`` [E, H, H] define expert ``e`` as ``rows @ mats[e]``."""

    name: str
    xs: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]
    mats: torch.Tensor
    payload_dtype: torch.dtype | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    received: list[int] = field(default_factory=list)


def experts_fn(mats: torch.Tensor) -> ExpertsFn:
    """Expert ``e`` of a case: ``rows @ mats[e]`` in float32."""
    return lambda expert, rows: rows.float() @ mats[expert]


def random_ids(gen: torch.Generator, tokens: int, experts: range) -> torch.Tensor:
    """[tokens, TOPK] distinct expert ids per token, uniform over ``experts``."""
    scores = torch.rand(tokens, len(experts), generator=gen)
    return scores.topk(TOPK, dim=1).indices + experts.start


def make_case(
    name: str,
    gen: torch.Generator,
    tokens: list[int],
    dtype: torch.dtype,
    experts: range = range(NUM_EXPERTS),
    payload_dtype: torch.dtype | None = None,
) -> Case:
    """A case with ``tokens[r]`` tokens on rank r, each routed to TOPK of ``experts``."""
    mats = torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    xs = [torch.randn(t, HIDDEN, generator=gen).to(dtype) for t in tokens]
    ids = [random_ids(gen, t, experts) for t in tokens]
    weights = [torch.rand(t, TOPK, generator=gen) for t in tokens]
    return Case(name, xs, ids, weights, mats, payload_dtype)


def _dispatcher(case: Case, world: int, rank: int) -> Dispatcher:
    if case.payload_dtype is not None:
        return AllToAllDispatcher(NUM_EXPERTS, payload_dtype=case.payload_dtype)
    parallel = ParallelConfig(tp_size=world, dp_size=world, enable_dp_attention=True, ep_size=world)
    return create_dispatcher(parallel, NUM_EXPERTS, rank)


def flat_round(d: Dispatcher, case: Case, rank: int) -> tuple[torch.Tensor, int]:
    """Rank ``rank``'s round of ``case`` through ``d``'s flat pair with the toy experts:
    what combine returned, and how many rows arrived."""
    got = d.dispatch(case.xs[rank], case.ids[rank], case.weights[rank])
    mine = local_experts(experts_fn(case.mats), rank * d.num_local_experts)
    y = moe_reference(got.x, got.topk_ids, got.topk_weights, mine).to(got.x.dtype)
    return d.combine(y, got), got.x.shape[0]


def _run_case(case: Case, world: int, rank: int) -> tuple[torch.Tensor, int]:
    return flat_round(_dispatcher(case, world, rank), case, rank)


def _factory_refusal(world: int, rank: int) -> str:
    """The factory's message for a layout whose EP group is not the process group."""
    parallel = ParallelConfig(tp_size=2 * world, ep_size=2 * world)
    try:
        create_dispatcher(parallel, NUM_EXPERTS, rank)
    except LayoutError as e:
        return str(e)
    return "no error"


def save_rank_results(results: object, root: Path, rank: int) -> None:
    """A spawned rank's results, written whole or not at all (renamed into place)."""
    tmp = root / f"rank{rank}.pt.tmp"
    torch.save(results, tmp)
    os.replace(tmp, root / f"rank{rank}.pt")


def spawn_for_results(main: Callable[..., None], args: tuple, world: int, root: Path) -> list:
    """``main(rank, *args)`` on ``world`` rank processes (``rank_procs.start_ranks``), then
    each rank's saved results.

    A rank that aborts after every rank saved its results does not fail the run: under
    CI's load a rank died in gloo's teardown ("terminate called without an active
    exception", SIGABRT, 2026-11-29) after its work was done and saved. One that aborts
    before that still fails it (its results are missing)."""
    try:
        start_ranks(main, args, world)
    except mp.ProcessExitedException:
        if not all((root / f"rank{r}.pt").exists() for r in range(world)):
            raise
        warnings.warn("a rank aborted after saving its results (teardown)", stacklevel=2)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(world)]


@contextmanager
def gloo_rank(rank: int, world: int, workdir: str) -> Iterator[Path]:
    """A spawned rank's life: one torch thread, the gloo group of ``world`` joined through a
    file in ``workdir`` (yielded as a Path), destroyed on the way out."""
    torch.set_num_threads(1)
    root = Path(workdir)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{root / 'pg'}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        yield root
        # no rank tears the group (and the store file under it) down while another still
        # runs its last collective: under CI's load a rank died in std::terminate there
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, workdir: str) -> None:
    with gloo_rank(rank, world, workdir) as root:
        cases: list[Case] = torch.load(root / "cases.pt", weights_only=False)
        results = {c.name: _run_case(c, world, rank) for c in cases}
        results["factory_refusal"] = _factory_refusal(world, rank)
        save_rank_results(results, root, rank)


def run_ranks(cases: list[Case], world: int, workdir: Path) -> tuple[list[Case], list[str]]:
    """Run every case on ``world`` spawned gloo ranks; fill ``outputs`` and ``received``.
    Also returns each rank's factory refusal message (see ``_factory_refusal``)."""
    torch.save(cases, workdir / "cases.pt")
    per_rank = spawn_for_results(_rank_main, (world, str(workdir)), world, workdir)
    for case in cases:
        case.outputs = [per_rank[r][case.name][0] for r in range(world)]
        case.received = [per_rank[r][case.name][1] for r in range(world)]
    return cases, [per_rank[r]["factory_refusal"] for r in range(world)]
