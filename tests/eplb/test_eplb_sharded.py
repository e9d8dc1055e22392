"""EPLB on real gloo ranks (EP2, EP4; tiny model, float32): with redundant experts under any
valid placement, switched in by moving weights between ranks (also mid-run), the logits and
greedy tokens equal the single-rank model's, and the summed per-rank load counts equal the
router's top-k counts on the same batch (also when decode batches are padded as a CUDA
graph's are: the padding rows are not counted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eplb_cases import EplbCase, deepep_worker, eplb_worker, group_steps, reference
from shard_util import run_ranks

from dsv3serve.eplb.placement import default_placement, place

TOL = {"rtol": 1e-4, "atol": 1e-4}  # fp32: only the summation order differs
LAYERS, EXPERTS, REDUNDANT = 4, 16, 4  # tiny: 3 MoE decoder layers + NextN


def random_valid(seed: int, physical: int) -> list[list[int]]:
    """Every expert once, the rest random duplicates, in a random order (any valid layout)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(LAYERS):
        extra = torch.randint(0, EXPERTS, (physical - EXPERTS,), generator=g)
        row = torch.cat([torch.arange(EXPERTS), extra])
        rows.append(row[torch.randperm(physical, generator=g)].tolist())
    return rows


def zipf_placement(ep: int, physical: int) -> list[list[int]]:
    load = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64).repeat(LAYERS, 1)
    return place(load, physical, ep).phy2log.tolist()


def cases(ep: int, model_dir: str) -> list[EplbCase]:
    p = EXPERTS + REDUNDANT
    steps = group_steps(ep)
    default = default_placement(LAYERS, EXPERTS, p, ep).phy2log.tolist()
    return [
        EplbCase(f"ep{ep}-default", ep, model_dir, [default], [], steps),
        EplbCase(
            f"ep{ep}-rebalance",
            ep,
            model_dir,
            [zipf_placement(ep, p), random_valid(ep, p), random_valid(ep + 7, p)],
            [1, 3],
            steps,
        ),
        EplbCase(f"ep{ep}-gather", ep, model_dir, [random_valid(ep + 1, p)], [], steps, "gather"),
        EplbCase(f"ep{ep}-padded", ep, model_dir, [random_valid(ep + 3, p)], [], steps, pad_to=4),
    ]


def check(case: EplbCase, out: Path) -> None:
    ref_logits, ref_counts = reference(case)
    counts = torch.zeros_like(ref_counts)
    for rank in range(case.ep):
        got = torch.load(out / f"{case.name}-rank{rank}.pt")
        counts += got["counts"]
        for step, logits in enumerate(got["logits"]):
            want = ref_logits[step][rank]
            torch.testing.assert_close(logits, want, **TOL, msg=f"{case.name} rank {rank}")
            assert torch.equal(logits.argmax(-1), want.argmax(-1))
    assert torch.equal(counts, ref_counts), case.name


@pytest.mark.parametrize("ep", [2, 4])
def test_eplb_equals_single_rank(ep: int, tiny_bf16_dir: Path, tmp_path: Path) -> None:
    todo = cases(ep, str(tiny_bf16_dir))
    run_ranks(ep, eplb_worker, todo, str(tmp_path))
    for case in todo:
        check(case, tmp_path)


@pytest.mark.parametrize("ep", [2, 4])
def test_deepep_flat_and_masked_take_physical_ids(ep: int, tmp_path: Path) -> None:
    """DeepEP (the fake over gloo; bf16) in normal and masked (decode) mode with 2 redundant
    slots per rank: the same expert sums as the logical experts on one rank."""
    phy2log = [random_valid(ep + 11, EXPERTS + 2 * ep)[0]]
    run_ranks(ep, deepep_worker, ep, phy2log, str(tmp_path))
    for rank in range(ep):
        got = torch.load(tmp_path / f"deepep-rank{rank}.pt")
        assert float(got["want"].float().abs().mean()) > 1e-3
        for phase in ("prefill", "decode"):
            torch.testing.assert_close(
                got[phase].float(), got["want"].float(), atol=1e-4, rtol=1e-2, msg=phase
            )
