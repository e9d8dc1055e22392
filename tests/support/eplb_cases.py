"""EPLB scenarios for gloo ranks: DP attention + EP with redundant experts, a placement
switched in by moving weights (also mid-run), against the single-rank model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import fake_deep_ep
import torch
from model_utils import load_ours, make_attn
from shard_util import GatherAllDispatcher, copy_shards_from_full, read_full_checkpoint
from sharded_cases import DTYPE, Span, build_batch

from dsv3serve.config import ModelConfig
from dsv3serve.eplb.expert_map import ExpertMap
from dsv3serve.eplb.placement import from_phy2log
from dsv3serve.eplb.rebalance import loaded_phy2log, rebalance
from dsv3serve.eplb.state import EplbState, moe_layer_count
from dsv3serve.eplb.stats import ExpertLoad
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions, MoE
from dsv3serve.moe.experts import random_experts
from dsv3serve.moe.ref import TorchRefMoE
from dsv3serve.moe.sharded import run_dispatched
from dsv3serve.parallel.comm import GroupComm
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.dispatch import DeepEPOptions, create_dispatcher
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.parallel.uniform import uniform_batch

SPARE_SEQ = 6  # a sequence index no case uses; its pages are nobody else's (page 7p + s)


@dataclass(frozen=True)
class EplbCase:
    """``placements[0]`` is filled after loading; ``placements[i]`` is switched in before
    step ``switch_at[i - 1]``. ``steps[s][g]``: DP group ``g``'s spans in step ``s``."""

    name: str
    ep: int
    model_dir: str
    placements: list[list[list[int]]]  # each [L, P]
    switch_at: list[int]
    steps: list[list[list[Span]]]
    dispatcher: str = "a2a"  # or "gather" (the test double)
    pad_to: int = 0  # > 0: decode steps padded to this many rows, as a CUDA graph's batch


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def group_steps(groups: int) -> list[list[list[Span]]]:
    """A prefill per group (group 0 two sequences), three decode steps, one group idle."""
    steps = [[[(g, _tokens(3 + g, 40 + g), 0)] for g in range(groups)]]
    steps[0][0].append((groups, _tokens(6, 39), 0))
    for s in range(3):
        step = [[(g, _tokens(1, 60 + 10 * s + g), 3 + g + s)] for g in range(groups)]
        step[0].append((groups, _tokens(1, 90 + s), 6 + s))
        if s == 1:
            step[groups - 1] = []
        steps.append(step)
    return steps


def _state(case: EplbCase, cfg: ModelConfig, rank: int) -> EplbState:
    p0 = from_phy2log(torch.tensor(case.placements[0]), cfg.n_routed_experts)
    layers = moe_layer_count(
        cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.num_nextn_predict_layers
    )
    load = ExpertLoad(layers, cfg.n_routed_experts, torch.device("cpu"))
    return EplbState(
        ExpertMap(p0, case.ep, rank, torch.device("cpu")), load, cfg.first_k_dense_replace
    )


def _model(case: EplbCase, rank: int, comm: GroupComm) -> tuple[DeepseekV3ForCausalLM, EplbState]:
    cfg = ModelConfig.from_hf(Path(case.model_dir))
    ep = case.ep
    parallel = ParallelConfig(tp_size=ep, dp_size=ep, enable_dp_attention=True, ep_size=ep)
    layout = RankLayout(parallel, rank)
    state = _state(case, cfg, rank)
    p = state.num_physical
    if case.dispatcher == "gather":
        dispatcher = GatherAllDispatcher(comm, layout, p)
    else:
        dispatcher = create_dispatcher(parallel, p, rank)
    opts = ModelOptions(dtype=DTYPE, layout=layout)
    return DeepseekV3ForCausalLM(cfg, opts, comm, dispatcher, state), state


def eplb_worker(rank: int, cases: list[EplbCase], result_dir: str) -> None:
    """Fill, place, run this rank's DP group's steps (switching placements), save."""
    comm = GroupComm()
    for case in cases:
        model, state = _model(case, rank, comm)
        copy_shards_from_full(model, read_full_checkpoint(Path(case.model_dir)))
        first = state.expert_map.placement
        old = loaded_phy2log(
            *first.phy2log.shape[:1], first.num_logical, first.num_physical, case.ep
        )
        rebalance(model.expert_stacks(), state, old, first)
        attn, logits = make_attn(model), []
        for s, spans in enumerate(case.steps):
            if s in case.switch_at:
                nxt = case.placements[case.switch_at.index(s) + 1]
                new = from_phy2log(torch.tensor(nxt), first.num_logical)
                rebalance(model.expert_stacks(), state, state.expert_map.placement.phy2log, new)
            logits.append(_step_logits(model, attn, spans[rank], case.pad_to if s else 0, s))
        assert state.load is not None
        out = {"logits": logits, "counts": state.load.read()}
        torch.save(out, Path(result_dir) / f"{case.name}-rank{rank}.pt")


def _step_logits(model, attn, spans: list[Span], pad_to: int, step: int) -> torch.Tensor:  # noqa: ANN001
    """This rank's logits of one step; with ``pad_to``, the decode batch is padded to that
    many rows with a spare sequence's tokens and run as a graph's uniform batch (its real rows
    first, their count a device scalar), and only the real rows' logits are kept."""
    if not pad_to:
        batch = build_batch(spans)
        return model.compute_logits(model(batch, attn)[batch.logits_indices])
    pad = (SPARE_SEQ, [7 + step] * (pad_to - len(spans)), 0)  # a decode span is one row
    batch = build_batch([*spans, pad] if pad_to > len(spans) else spans)
    with uniform_batch(pad_to, torch.tensor(len(spans))):
        hidden = model(batch, attn)[batch.logits_indices]
    return model.compute_logits(hidden[: len(spans)])


def reference(case: EplbCase) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Single-rank logits [step][group] and the router's top-k counts [L, E] on the batch."""
    model = load_ours(Path(case.model_dir), dtype=DTYPE)
    cfg = model.cfg
    layers = moe_layer_count(
        cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.num_nextn_predict_layers
    )
    counts = torch.zeros(layers, cfg.n_routed_experts, dtype=torch.int64)
    for name, m in model.named_modules():
        if isinstance(m, MoE) and name.startswith("layers."):  # NextN does not run here
            row = int(name.split(".")[1]) - cfg.first_k_dense_replace
            m.route = _counting(m.route, counts[row])
    attn, out = make_attn(model), []
    for step in case.steps:
        batch = build_batch([s for group in step for s in group])
        logits = model.compute_logits(model(batch, attn)[batch.logits_indices])
        sizes = [sum(len(t) for _, t, _ in group) for group in step]
        out.append(list(logits.split(sizes)))
    return out, counts


def _counting(route, counts: torch.Tensor):  # noqa: ANN001, ANN202 (wraps the backend's route)
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        weights, ids = route(*args, **kwargs)
        for e in ids.flatten().tolist():
            counts[e] += 1
        return weights, ids

    return wrapped


def deepep_worker(rank: int, world: int, phy2log: list[list[int]], result_dir: str) -> None:
    """One MoE layer through the DeepEP fake (flat and masked) with physical ids from the
    map, vs the logical experts on one rank (bf16: DeepEP's payload)."""
    experts, seed = 16, 5
    torch.manual_seed(seed)
    ex = random_experts(experts, 128, 64, False, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(9 - 2 * rank, 128, generator=g.manual_seed(seed + rank)).bfloat16()
    ids = torch.rand(x.shape[0], experts, generator=g).topk(4, 1).indices
    w = torch.rand(x.shape[0], 4, generator=g)
    placement = from_phy2log(torch.tensor(phy2log), experts)
    slots = placement.num_physical // world
    held = placement.phy2log[0, rank * slots : (rank + 1) * slots]
    mine = random_experts(slots, 128, 64, False, torch.bfloat16, "cpu")
    mine.w13.data.copy_(ex.w13[held])
    mine.w2.data.copy_(ex.w2[held])
    phys = ExpertMap(placement, world, rank, torch.device("cpu")).to_physical(0, ids)
    parallel = ParallelConfig(
        tp_size=world, dp_size=world, enable_dp_attention=True, ep_size=world,
        moe_a2a_backend="deepep", deepep_mode="auto",
    )  # fmt: skip
    opts = DeepEPOptions(128, 16, module=fake_deep_ep.make_module())
    d = create_dispatcher(parallel, placement.num_physical, rank, deepep=opts)
    args = (TorchRefMoE(), x, w, phys, mine)
    out = {
        "prefill": run_dispatched(d, *args, decode=False),
        "decode": run_dispatched(d, *args, decode=True),
        "want": TorchRefMoE().forward(x, w, ids, ex),
    }
    torch.save(out, Path(result_dir) / f"deepep-rank{rank}.pt")
