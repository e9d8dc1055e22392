"""EPLB in the engine: a rank's initial placement, the fill after loading, and the periodic
rebalance every ``eplb_rebalance_num_iterations`` group steps (docs/eplb.md)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dsv3serve.config import ModelConfig
from dsv3serve.eplb.expert_map import ExpertMap
from dsv3serve.eplb.placement import Placement, default_placement, place
from dsv3serve.eplb.rebalance import loaded_phy2log, rebalance
from dsv3serve.eplb.state import EplbState, moe_layer_count
from dsv3serve.eplb.stats import ExpertLoad, dump, hot_ratio, load_dump
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsv3serve.parallel.config import ParallelConfig, uses_eplb
from dsv3serve.parallel.shard import RankLayout


def num_moe_layers(cfg: ModelConfig) -> int:
    return moe_layer_count(
        cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.num_nextn_predict_layers
    )


def initial_placement(parallel: ParallelConfig, cfg: ModelConfig) -> Placement:
    """From ``init_expert_location``'s load dump, else the block layout plus round-robin
    redundant copies."""
    e, ep = cfg.n_routed_experts, parallel.ep_size
    physical, layers = e + parallel.ep_num_redundant_experts, num_moe_layers(cfg)
    if parallel.init_expert_location is None:
        return default_placement(layers, e, physical, ep)
    counts = load_dump(Path(parallel.init_expert_location), layers, e)
    return place(counts, physical, ep, cfg.n_group)


def eplb_state(
    parallel: ParallelConfig, cfg: ModelConfig, rank: int, device: torch.device
) -> EplbState | None:
    """This rank's EPLB state (None when the layout uses no EPLB)."""
    if not uses_eplb(parallel):
        return None
    ep = parallel.ep_size
    ep_rank = RankLayout(parallel, rank).tp_rank(ep)
    expert_map = ExpertMap(initial_placement(parallel, cfg), ep, ep_rank, device)
    load = ExpertLoad(num_moe_layers(cfg), cfg.n_routed_experts, device)
    return EplbState(expert_map, load, cfg.first_k_dense_replace)


class EplbRuntime:
    """Drives one rank's EPLB: every rank of the group calls :meth:`fill` once after
    loading and :meth:`tick` after every group step (the steps are in lockstep)."""

    def __init__(self, state: EplbState, parallel: ParallelConfig, cfg: ModelConfig) -> None:
        self.state, self.parallel, self.cfg = state, parallel, cfg
        self.steps = 0
        self.rebalances = 0
        self.hot_ratios: list[float] = []  # per MoE layer, the last window's (the metric)

    def fill(self, model: DeepseekV3ForCausalLM) -> None:
        """Move the loaded block layout's experts into the initial placement."""
        p = self.state.expert_map.placement
        old = loaded_phy2log(int(p.phy2log.shape[0]), p.num_logical, p.num_physical, self.ep)
        rebalance(model.expert_stacks(), self.state, old, p)

    @property
    def ep(self) -> int:
        return self.parallel.ep_size

    def global_counts(self) -> torch.Tensor:
        """[L, E] tokens per logical expert summed over the group's ranks (collective)."""
        assert self.state.load is not None
        counts = self.state.load.read()
        dist.all_reduce(counts)
        return counts

    def tick(self, model: DeepseekV3ForCausalLM) -> None:
        """Count a group step; with ``enable_eplb``, rebalance every N steps."""
        self.steps += 1
        n = self.parallel.eplb_rebalance_num_iterations
        if self.parallel.enable_eplb and self.steps % n == 0:
            self.rebalance_now(model)

    def rebalance_now(self, model: DeepseekV3ForCausalLM) -> None:
        """Place by the group's counts since the last rebalance, move, switch (collective)."""
        counts = self.global_counts()
        self.hot_ratios = hot_ratio(counts)
        p = self.state.expert_map.placement
        new = place(counts.double(), p.num_physical, self.ep, self.cfg.n_group)
        rebalance(model.expert_stacks(), self.state, p.phy2log, new)
        assert self.state.load is not None
        self.state.load.reset()
        self.rebalances += 1

    def dump(self, path: Path) -> None:
        """Write the group's counts for ``--init-expert-location`` (collective; rank 0
        writes)."""
        counts = self.global_counts()
        if dist.get_rank() == 0:
            dump(path, counts)
