"""What one rank of a group needs to build its shard: layout, collectives, dispatcher.

A group's ranks have joined one torch.distributed process group before any builds its
model (``tp_size`` ranks, this one ``dist.get_rank()``); a one-rank engine needs none.
On a GPU the memory planner checks the layout before anything is allocated.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.eplb_runtime import eplb_state
from dsv3serve.eplb.state import EplbState
from dsv3serve.parallel.comm import Comm, make_comm
from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.dispatch import DeepEPOptions, create_dispatcher
from dsv3serve.parallel.dispatch_a2a import AllToAllDispatcher
from dsv3serve.parallel.dispatch_base import Dispatcher
from dsv3serve.parallel.dispatch_gather import UniformGatherDispatcher
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.plan.planner import plan


@dataclass(frozen=True)
class RankParts:
    """This rank's layout (None: one rank), collectives, MoE dispatcher and EPLB state."""

    layout: RankLayout | None = None
    comm: Comm | None = None
    dispatcher: Dispatcher | None = None
    eplb: EplbState | None = None

    @property
    def in_group(self) -> bool:
        return self.layout is not None

    @property
    def graph_safe(self) -> bool:
        """Whether decode steps can be captured into CUDA graphs: one rank, or collectives
        (NCCL, the timing-only loopback) and a dispatcher that say so."""
        comm_ok = self.comm is None or self.comm.graph_safe
        return comm_ok and self.uniform_safe

    @property
    def uniform_safe(self) -> bool:
        """Whether the MoE dispatcher has a fixed-shape path for uniform batches (what a
        graph replays), whatever the collectives' backend."""
        return self.dispatcher is None or self.dispatcher.graph_safe

    def check_layout(self, parallel: ParallelConfig) -> RankParts:
        """``self`` if its layout is ``parallel`` (the engine config's), else LayoutError."""
        found = None if self.layout is None else self.layout.parallel
        if found != (parallel if parallel.world_size > 1 else None):
            raise LayoutError(
                f"expected rank parts for the engine's layout {parallel}, found {found}"
            )
        return self


def rank_parts(cfg: EngineConfig, model_cfg: ModelConfig) -> RankParts:
    """The parts for this process's rank of ``cfg``'s group."""
    if cfg.tp_size == 1:
        return RankParts()
    if not dist.is_initialized() or dist.get_world_size() != cfg.tp_size:
        found = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise LayoutError(
            f"tp_size {cfg.tp_size}: expected every rank to have joined a process group of "
            f"{cfg.tp_size} before building the engine, found {found} (LLM, `dsv3serve` and "
            "the Ray workers start the ranks)"
        )
    rank = dist.get_rank()
    layout = RankLayout(cfg.parallel, rank)
    comm = make_comm()
    dispatcher = None
    eplb = eplb_state(cfg.parallel, model_cfg, rank, torch.device(cfg.device))
    if cfg.enable_dp_attention and cfg.ep_size > 1:
        # EPLB: the dispatchers see physical expert slots (logical ids are mapped before)
        slots = model_cfg.n_routed_experts if eplb is None else eplb.num_physical
        options = _deepep_options(cfg, model_cfg)
        metered = not cfg.disable_moe_dispatch_metrics
        dispatcher = create_dispatcher(cfg.parallel, slots, rank, deepep=options, metered=metered)
        if isinstance(dispatcher, AllToAllDispatcher):  # graphed decode steps gather instead
            dispatcher = UniformGatherDispatcher(dispatcher, comm)
    return RankParts(layout, comm, dispatcher, eplb)


def _deepep_options(cfg: EngineConfig, model_cfg: ModelConfig) -> DeepEPOptions:
    """DeepEP's buffer sizes from the engine's batch bounds. Masked (low-latency) calls are
    sized by the per-rank decode bound, ``max_running_requests`` (every decode step fits;
    under ``low_latency`` a larger prefill batch goes in rounds of it), never by
    ``max_num_batched_tokens``; normal mode by DeepEP's own chunked buffer. Rows travel as
    e4m3 with 1x128 scales when the experts are FP8 with activation quantisation (the fused
    MoE quantises the same way), so the masked MoE runs on them as they arrive."""
    fp8 = model_cfg.quant_method == "fp8" and cfg.fp8_act_quant
    return DeepEPOptions(
        model_cfg.hidden_size,
        cfg.max_running_requests,
        fp8_dispatch=fp8,
        device=torch.device(cfg.device),
    )


def agree_on_pages(num_pages: int, device: torch.device) -> int:
    """The smallest KV capacity of all ranks (on a GPU each computes its own from its free
    device memory)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return num_pages
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    pages = torch.tensor([num_pages], dtype=torch.int64, device=on)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN)
    return int(pages)


def ranks_on_this_host() -> int:
    """How many ranks of this process's group run on this host (1 without a group): they
    share the host's CPU KV budget. A collective: every rank of the group calls it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 1
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts.count(socket.gethostname())


def check_fits(cfg: EngineConfig, model_cfg: ModelConfig, device: torch.device) -> None:
    """On a GPU: refuse a layout the memory planner says does not fit, before loading.

    Only where the KV capacity comes from ``mem_fraction_static`` (the planner's budget);
    an explicit ``num_kv_tokens`` (tests, benchmarks) sizes the pool itself.
    """
    if device.type != "cuda" or cfg.num_kv_tokens is not None:
        return
    total = torch.cuda.get_device_properties(device).total_memory / 1e9
    plan(
        model_cfg,
        cfg.parallel,
        total,
        cfg.mem_fraction_static,
        cfg.page_size,
        cfg.kv_cache_dtype,
        cfg.cuda_graph_max_bs,
        disable_cuda_graph=cfg.disable_cuda_graph,
        max_running_requests=cfg.max_running_requests,
        attention_backend=cfg.attention_backend,
    )
