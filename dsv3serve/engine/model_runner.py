"""One rank's model execution: weights, KV pool, attention backend and the forward step."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dsv3serve.attention import MLADims, attention_backend_class, create_attention_backend
from dsv3serve.config import ModelConfig
from dsv3serve.engine.compile import decode_model, warn_if_compile_unused
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.cuda_graph import DecodeGraphs, capture_sizes
from dsv3serve.engine.eplb_runtime import EplbRuntime
from dsv3serve.engine.future_tokens import FutureTokens
from dsv3serve.engine.gemm_log import log_gemm_backends
from dsv3serve.engine.graph_capture import GraphPool
from dsv3serve.engine.group.rank_parts import RankParts, agree_on_pages, check_fits, rank_parts
from dsv3serve.engine.kv_size import agreed_size, rank_kv_size
from dsv3serve.engine.scheduler.sequence import ScheduledItem
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kvcache.pool import FP8Scales, MLAKVPool, bytes_per_page
from dsv3serve.kvcache.sizing import KVSize
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions
from dsv3serve.model.weights import load_weights
from dsv3serve.page_table import slots_of
from dsv3serve.parallel.deepep_sizes import planned_deepep
from dsv3serve.plan.planner import PlanSettings, reserves

if TYPE_CHECKING:
    from dsv3serve.attention.base import CudaGraphLimits

logger = logging.getLogger(__name__)
# "1": run the CUDA-graph decode path (padding, static buffers, group-agreed sizes) without
# capture where there is no CUDA, so CPU tests cover what a GPU group replays.
EAGER_GRAPH_PATH_ENV = "DSV3SERVE_EAGER_GRAPH_PATH"


def resolve_dtype(cfg: EngineConfig) -> torch.dtype:
    """``auto`` is bfloat16 on GPU and float32 on CPU (CPU bf16 matmuls are slow)."""
    if cfg.dtype == "auto":
        return torch.float32 if torch.device(cfg.device).type == "cpu" else torch.bfloat16
    return getattr(torch, cfg.dtype)


def kv_slots(page_table: list[int], page_size: int, num_tokens: int) -> list[int]:
    """Cache slots of positions ``0 .. num_tokens-1`` of a sequence (O(num_tokens); a
    step's spans should carry page tables instead: :meth:`SeqSpan.from_pages`)."""
    return slots_of(page_table, page_size, 0, num_tokens).tolist()


@dataclass
class StepResult:
    """Logits [N, V] (float32) for the items with ``sample=True``, in item order."""

    logits: torch.Tensor
    sampled_items: list[ScheduledItem]


class ModelRunner:
    """Builds the model and its KV pool on one device and runs scheduled batches.

    ``parts``: this rank's layout, collectives and dispatcher, given instead of joined from
    torch.distributed (the one-GPU timing-only loopback of ``benchmarks/bench_ep_rank.py``);
    they must match ``cfg``'s layout. CUDA graphs stay on if they are graph safe.
    ``kv_size``: the size its KV pool was given and why (:mod:`dsv3serve.engine.kv_size`).
    """

    def __init__(
        self,
        cfg: EngineConfig,
        model_dir: Path | None,
        model_cfg: ModelConfig,
        parts: RankParts | None = None,
    ):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # a group rank's process drives cuda:r: streams, graph capture and cuBLAS follow
            # the current device, not the tensors'
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(cfg)
        check_fits(cfg, model_cfg, self.device)
        self.parts = (
            rank_parts(cfg, model_cfg) if parts is None else parts.check_layout(cfg.parallel)
        )
        opts = ModelOptions(
            dtype=self.dtype,
            attn_impl=cfg.attn_impl,
            fp8_act_quant=cfg.fp8_act_quant,
            moe_backend=cfg.moe_backend,
            shared_experts_fusion=cfg.shared_experts_fusion,
            layout=self.parts.layout,
        )
        with torch.device(self.device):
            p = self.parts
            self.model = DeepseekV3ForCausalLM(model_cfg, opts, p.comm, p.dispatcher, p.eplb)
        load_weights(self.model, model_dir, cfg.load_format, self.parts.layout)
        max_m = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None
        log_gemm_backends(
            model_cfg, self.parts.layout, self.device, self.dtype, cfg.fp8_act_quant,
            max_m or cfg.max_num_batched_tokens,
        )  # fmt: skip
        self.eplb = None if p.eplb is None else EplbRuntime(p.eplb, cfg.parallel, model_cfg)
        if self.eplb is not None:
            self.eplb.fill(self.model)
        self.future: FutureTokens | None = None  # overlap scheduler's placeholder tokens
        if cfg.overlap_schedule:
            self.future = FutureTokens(3 * cfg.max_running_requests + 1, self.device)
            self.future.install(self.model.embed_tokens)
        use_graphs = self._use_cuda_graphs()
        warn_if_compile_unused(cfg, use_graphs)
        self._scratch_pages = self._num_scratch_pages() if use_graphs else 0
        self.kv_size = self._kv_size()
        self.pool = self._make_pool()
        self.attn = create_attention_backend(
            cfg.attention_backend,
            self.pool,
            model_cfg.kv_lora_rank,
            MLADims.from_config(model_cfg, cfg.parallel.attn_tp_size),
            cuda_graph=self._graph_limits() if use_graphs and self._capture else None,
        )
        self.graphs: DecodeGraphs | None = None
        # the memory pool every CUDA graph of this rank shares
        self.graph_pool: GraphPool | None = None
        self._other_graphs: list[Callable[[], None]] = []  # release() of graphs built on it
        if use_graphs:
            self.graphs = self._decode_graphs()

    @property
    def _capture(self) -> bool:
        """Graphs are captured on CUDA; elsewhere the graph path can only run eagerly."""
        return self.device.type == "cuda"

    def _decode_graphs(self) -> DecodeGraphs:
        """Capture the decode graphs (every rank of a group in the same order: their warm-up
        runs the group's collectives); a decode step, for a dispatcher that picks its mode."""
        if self._capture:
            self.graph_pool = torch.cuda.graph_pool_handle()
        sizes = capture_sizes(self._graph_max_bs())
        self.set_step_phase(decode=True)
        self.prepare_graph()
        try:
            return DecodeGraphs(
                decode_model(self.model, self.cfg, sizes),
                self.attn,
                self.device,
                sizes,
                self.scratch_slots(1)[0],
                capture=self._capture,
                mempool=self.graph_pool,
            )
        finally:
            self.set_step_phase(decode=False)

    def prepare_graph(self) -> None:
        """What the MoE dispatcher needs done on the host before a graph is captured or
        replayed (DeepEP ``auto``: the low-latency buffer's clean after a normal step)."""
        if self.parts.dispatcher is not None:
            self.parts.dispatcher.prepare_graph()

    def release_on_close(self, release: Callable[[], None]) -> None:
        """Have :meth:`close` call ``release``: the release of CUDA graphs that others build
        on this rank's pool and attention (the speculative graphs)."""
        self._other_graphs.append(release)

    def close(self) -> None:
        """Release what this rank holds with the others: every CUDA graph captured on it
        (their captured collectives hold the communicator: a TP group's
        ``destroy_process_group`` hung on two H200s while its speculative graphs lived) and
        the MoE dispatcher's buffers. A group's ranks call it together, after their last
        step and before leaving the group."""
        for release in self._other_graphs:
            release()
        if self.graphs is not None:
            self.graphs.release()
        if self.parts.dispatcher is not None:
            self.parts.dispatcher.close()

    def set_step_phase(self, decode: bool, max_tokens: int = 0) -> None:
        """Tell the MoE dispatcher whether the group's step is a decode step and the most
        tokens any rank forwards in it (every rank of a group sets the same values: they
        travel in the DP step header; 0: not known, each rank's own count is used)."""
        if self.parts.dispatcher is not None:
            self.parts.dispatcher.step_is_decode = decode
            self.parts.dispatcher.step_max_tokens = max_tokens

    @property
    def graphs_by_group(self) -> bool:
        """Under DP attention the leader decides each step whether every rank replays a graph
        and of which size (:mod:`dsv3serve.engine.group.dp`); ``run_spans`` never does."""
        layout = self.parts.layout
        return layout is not None and layout.parallel.enable_dp_attention

    def _use_cuda_graphs(self) -> bool:
        """Decode CUDA graphs: on CUDA with a backend that supports them, unless disabled or
        the group's collectives cannot be captured. Without CUDA, :data:`EAGER_GRAPH_PATH_ENV`
        runs the same padded path uncaptured (tests of the group's graph agreement)."""
        c = self.cfg
        if c.disable_cuda_graph:
            return False
        if self.device.type != "cuda":
            return os.environ.get(EAGER_GRAPH_PATH_ENV) == "1" and self.parts.uniform_safe
        if not self.parts.graph_safe:
            logger.info(
                "CUDA graphs off: this group's collectives or MoE dispatcher cannot be "
                "captured (NCCL and a graph-safe dispatcher are needed)"
            )
            return False
        return attention_backend_class(c.attention_backend, self._kv_dtype()).supports_cuda_graphs

    def _num_scratch_pages(self) -> int:
        """Pages for the padding rows of captured batches: a speculative verify pads with
        ``spec_num_steps + 1`` tokens per dummy sequence, a decode step with one."""
        return -(-(self.cfg.spec_num_steps + 1) // self.cfg.page_size)

    def scratch_slots(self, num_tokens: int) -> list[int]:
        """Slots of positions ``0 .. num_tokens-1`` on the scratch pages (the pool's last
        pages, never handed out), page-aligned like a sequence's own."""
        first = self.pool.num_pages - self._scratch_pages
        if num_tokens > self._scratch_pages * self.cfg.page_size:
            raise ValueError(
                f"expected at most {self._scratch_pages * self.cfg.page_size} scratch "
                f"slots ({self._scratch_pages} pages), asked for {num_tokens}"
            )
        pages = list(range(first, self.pool.num_pages))
        return kv_slots(pages, self.cfg.page_size, num_tokens)

    def _graph_limits(self) -> CudaGraphLimits:
        from dsv3serve.attention.base import CudaGraphLimits

        c = self.cfg  # a sequence holds at most the longest request plus a verify's drafts
        longest = (c.max_model_len or self.model_cfg.max_position_embeddings) + c.spec_num_steps + 1
        return CudaGraphLimits.for_pool(
            self._graph_max_bs(), self.pool.num_pages, c.page_size, longest
        )

    def _graph_max_bs(self) -> int:
        """No graph larger than the scheduler's batch can ever be."""
        return min(self.cfg.cuda_graph_max_bs, self.cfg.max_running_requests)

    def _kv_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.cfg.kv_cache_dtype == "fp8_e4m3" else self.dtype

    def _fp8_scales(self) -> FP8Scales:
        """The scale layout the attention backend reads an fp8 pool in."""
        return attention_backend_class(self.cfg.attention_backend, self._kv_dtype()).fp8_scales

    def _reserved_bytes(self) -> int:
        """What the planner sets aside beside the KV (``dsv3serve.plan``): the decode graphs,
        the activations of the largest prefill step (``max_num_batched_tokens`` tokens
        when that exceeds the chunk: one step may hold several chunks) and DeepEP's
        low-latency activations (its NVLink / NVSHMEM buffers are allocated already, so
        the free memory the pool is sized from has them out)."""
        step = max(self.cfg.chunked_prefill_size, self.cfg.max_num_batched_tokens)
        settings = PlanSettings(
            gpu_memory_gb=1.0,  # not used by the reserves
            cuda_graph_max_bs=self._graph_max_bs(),
            disable_cuda_graph=self.cfg.disable_cuda_graph,
            chunked_prefill_size=step,
            max_running_requests=self.cfg.max_running_requests,
        )
        graph, activation = reserves(settings, self.cfg.parallel.world_size)
        deepep = planned_deepep(self.model_cfg, self.cfg.parallel, self.cfg.max_running_requests)
        return graph + activation + (0 if deepep is None else deepep.activations)

    def _kv_size(self) -> KVSize:
        """The pool's size, agreed with the group and logged with its reason."""
        kv_dim, token_scales = self.model_cfg.kv_cache_dim, self._fp8_scales() == "token"
        page_bytes = bytes_per_page(
            self.model.num_kv_layers, self.cfg.page_size, self._kv_dtype(), kv_dim, token_scales
        )
        own = rank_kv_size(
            self.cfg,
            self.model_cfg,
            self.device,
            page_bytes,
            self._scratch_pages,
            self._reserved_bytes,
        )
        size = agreed_size(own, agree_on_pages(own.pages, self.device))
        logger.info("KV pool: %s", size.describe())
        return size

    def _make_pool(self) -> MLAKVPool:
        return MLAKVPool(
            self.model.num_kv_layers,
            self.kv_size.pages,
            self.cfg.page_size,
            self.model_cfg.kv_cache_dim,
            self._kv_dtype(),
            self.device,
            compute_dtype=self.dtype,
            fp8_scales=self._fp8_scales(),
        )

    @property
    def num_pages(self) -> int:
        """Pages the scheduler may hand out (the last ones are scratch with CUDA graphs)."""
        return self.pool.num_pages - self._scratch_pages

    def spans(self, items: list[ScheduledItem]) -> list[SeqSpan]:
        """The scheduled items as device-independent spans (what a group broadcasts),
        each over the pages it uses: O(batch + pages), no per-token work."""
        page = self.cfg.page_size
        return [
            SeqSpan.from_pages(item.token_ids, item.start, item.seq.page_table, page, item.sample)
            for item in items
        ]

    def run(self, items: list[ScheduledItem]) -> StepResult:
        """Forward the scheduled tokens; logits only where a token will be sampled."""
        return self.run_spans(self.spans(items), items)

    def share_sampled(self, start: int, token_ids: torch.Tensor) -> None:
        """Overlap scheduling hands a step's sampled ids to a group's other ranks; one rank
        has none (a group leader overrides this)."""

    def run_spans(self, spans: list[SeqSpan], items: list[ScheduledItem] | None) -> StepResult:
        """Forward ``spans``; ``items`` (None on follower ranks) label the sampled rows."""
        sampled = [item for item in items or [] if item.sample]
        if self.graphs is not None and not self.graphs_by_group and self.graphs.can_run(spans):
            self.prepare_graph()
            return StepResult(self.graphs.run(spans), sampled)
        batch = ForwardBatch.build(spans, self.device)
        hidden = self.model(batch, self.attn)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return StepResult(logits, sampled)

    def _page_slots(self, pages: list[int]) -> torch.Tensor:
        """Every slot of ``pages``, page by page: [len(pages) * page_size]."""
        page = self.cfg.page_size
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        return (idx[:, None] * page + torch.arange(page, device=self.device)).flatten()

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """KV of ``pages`` for every layer: [layers, len(pages), page_size, 576]."""
        slots = self._page_slots(pages)
        per_layer = [self.pool.read(layer, slots) for layer in range(self.pool.num_layers)]
        return torch.stack(per_layer).view(self.pool.num_layers, len(pages), self.cfg.page_size, -1)

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """Inverse of :meth:`read_pages`."""
        slots = self._page_slots(pages)
        for layer in range(self.pool.num_layers):
            self.pool.write(layer, slots, kv[layer].reshape(len(slots), -1).to(self.device))
