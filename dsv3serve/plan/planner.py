"""Per-rank device memory of a parallel layout, from the config alone, refused if it won't fit.

Weights: the checkpoint's tensors (:mod:`dsv3serve.plan.checkpoint`: names, full shapes and
dtypes written from the published spec by :func:`~dsv3serve.model.tiny.checkpoint_shapes`, no
file read), each rank's part taken by :func:`~dsv3serve.parallel.shard_tensors.local_tensors`,
the loader's own code. Then the KV cache gets what is left of ``gpu_memory_gb *
mem_fraction_static`` after the weights, the absorbed MLA weights ``post_load`` derives, and
the reserves below.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict

import torch

from dsv3serve.attention import attention_backend_class
from dsv3serve.config import ModelConfig
from dsv3serve.kvcache.pool import bytes_per_page

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.deepep_sizes import DeepEPBytes, planned_deepep
from dsv3serve.parallel.shard import RankLayout, check_model
from dsv3serve.parallel.shard_tensors import TensorInfo, local_tensors
from dsv3serve.plan.checkpoint import KINDS, checkpoint_infos, kind_of, nextn_shared_names

GB = 1e9  # decimal, as GPU memory is quoted (H200: 141 GB)
# Device memory a bf16 full-width DeepSeek-V3 rank used beyond weights + KV pool with decode
# CUDA graphs captured up to bs 64 and no prefill: 0.76 GB (42.18 - 38.96 - 2.45 GB peak /
# weights / KV in docs/perf/bench_model_h200_pages_3moe.json), i.e. ~12 MB per captured row.
GRAPH_BYTES_PER_BS = 12_000_000
# The same run with 4K-token prefills on top peaked 2.01 GB beyond weights + KV
# (bench_model_h200.json: 140.91 - 131.53 - 7.36): ~1.25 GB more for 4096 prefill tokens.
ACTIVATION_BYTES_PER_PREFILL_TOKEN = 310_000
# Not measured here: NCCL / DeepEP buffers of a group of more than one rank (a guess).
COLLECTIVE_RESERVE_BYTES = 1_000_000_000
KVCacheDType = Literal["auto", "fp8_e4m3"]


class PlanError(ValueError):
    """A layout that does not fit; the message has the numbers, ``plan`` the whole table."""

    def __init__(self, message: str, plan: Plan | None = None) -> None:
        super().__init__(message)
        self.plan = plan


class PlanExtras(TypedDict, total=False):
    """The :class:`PlanSettings` fields that :func:`plan` takes by keyword only."""

    disable_cuda_graph: bool
    chunked_prefill_size: int
    context_length: int | None
    hicache_ratio: float | None
    hicache_size: int | None
    max_running_requests: int
    attention_backend: str


@dataclass(frozen=True)
class PlanSettings:
    """The memory knobs (SGLang's names); ``context_length`` None: no request-length floor.

    ``hicache_ratio`` / ``hicache_size`` (GB of 1e9 bytes): the hierarchical cache's host
    tier per rank, as the engine sizes it; both None: no host tier."""

    gpu_memory_gb: float
    mem_fraction_static: float = 0.85
    page_size: int = 64
    kv_cache_dtype: KVCacheDType = "auto"
    cuda_graph_max_bs: int = 64
    disable_cuda_graph: bool = False
    chunked_prefill_size: int = 8192
    context_length: int | None = None
    hicache_ratio: float | None = None
    hicache_size: int | None = None
    max_running_requests: int = 256
    attention_backend: str = "flashinfer"  # decides an fp8 pool's scale layout

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static <= 1 or self.gpu_memory_gb <= 0:
            raise ValueError(
                f"expected gpu_memory_gb > 0 and 0 < mem_fraction_static <= 1, got "
                f"{self.gpu_memory_gb} and {self.mem_fraction_static}"
            )
        if self.hicache_ratio is not None and self.hicache_size is not None:
            raise ValueError("hicache_ratio and hicache_size: found both, expected at most one")
        if (self.hicache_ratio or 1) <= 0 or (self.hicache_size or 1) < 1:
            raise ValueError(
                f"expected hicache_ratio > 0 and hicache_size >= 1, got "
                f"{self.hicache_ratio} and {self.hicache_size}"
            )
        if (
            min(
                self.page_size,
                self.cuda_graph_max_bs,
                self.chunked_prefill_size,
                self.max_running_requests,
            )
            < 1
        ):
            raise ValueError(
                "page_size, cuda_graph_max_bs, chunked_prefill_size and max_running_requests "
                "must be >= 1"
            )


@dataclass(frozen=True)
class RankPlan:
    """One rank's device bytes: checkpoint weights by kind and the derived absorbed MLA."""

    rank: int
    weight_bytes: dict[str, int]
    absorbed_mla_bytes: int

    @property
    def weights_total(self) -> int:
        return sum(self.weight_bytes.values())

    @property
    def static_total(self) -> int:
        return self.weights_total + self.absorbed_mla_bytes


@dataclass(frozen=True)
class Plan:
    """Every rank's weights, the reserves and the KV capacity of the worst rank."""

    parallel: ParallelConfig
    settings: PlanSettings
    ranks: tuple[RankPlan, ...]
    graph_reserve_bytes: int
    activation_reserve_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    min_kv_tokens: int
    deepep: DeepEPBytes | None = None

    @property
    def deepep_bytes(self) -> int:
        return 0 if self.deepep is None else self.deepep.total

    @property
    def budget_bytes(self) -> int:
        s = self.settings
        return int(s.gpu_memory_gb * GB * s.mem_fraction_static)

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.static_total)

    @property
    def fixed_bytes(self) -> int:
        """Weights, absorbed MLA, reserves and DeepEP's buffers of the worst rank: all but the
        KV cache."""
        reserves = self.graph_reserve_bytes + self.activation_reserve_bytes + self.deepep_bytes
        return self.worst.static_total + reserves

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def host_kv_tokens(self) -> int:
        """Tokens the hierarchical cache's host tier holds per rank (0: no tier)."""
        s = self.settings
        page_bytes = self.kv_bytes_per_token * s.page_size
        if s.hicache_size is not None:
            pages = s.hicache_size * 10**9 // page_bytes
        elif s.hicache_ratio is not None:
            pages = int(self.kv_tokens // s.page_size * s.hicache_ratio)
        else:
            return 0
        return pages * s.page_size

    @property
    def host_kv_bytes(self) -> int:
        """Host memory the host tier takes per rank (pinned on CUDA)."""
        return self.host_kv_tokens * self.kv_bytes_per_token


def rank_plan(
    infos: dict[str, TensorInfo], layout: RankLayout, cfg: ModelConfig, skip: tuple[str, ...]
) -> RankPlan:
    """Bytes of what ``layout.rank`` loads, by kind, plus its absorbed MLA weights and its
    EPLB redundant expert slots (``ep_num_redundant_experts / ep_size`` per MoE layer)."""
    by_kind: Counter[str] = Counter(dict.fromkeys(KINDS, 0))
    for t in local_tensors(infos, layout, cfg.n_routed_experts, skip):
        by_kind[kind_of(t.name, cfg.num_hidden_layers)] += t.nbytes
    by_kind.update(redundant_expert_bytes(infos, cfg, layout.parallel))
    return RankPlan(layout.rank, dict(by_kind), absorbed_mla_bytes(cfg, layout.parallel))


def redundant_expert_bytes(
    infos: dict[str, TensorInfo], cfg: ModelConfig, parallel: ParallelConfig
) -> Counter[str]:
    """Bytes of one rank's redundant expert slots, by kind: each MoE layer's expert 0
    tensors (every expert has the same) times the slots per rank."""
    slots = parallel.ep_num_redundant_experts // parallel.ep_size
    out: Counter[str] = Counter()
    for name, info in infos.items():
        if slots and ".mlp.experts.0." in name:
            numel = torch.Size(info.shape).numel()
            out[kind_of(name, cfg.num_hidden_layers)] += slots * numel * info.itemsize
    return out


def absorbed_mla_bytes(cfg: ModelConfig, parallel: ParallelConfig) -> int:
    """W_UK and W_UV (kv_b_proj dequantised to bf16, the rank's heads) of every KV layer."""
    heads = cfg.num_attention_heads // parallel.attn_tp_size
    per_layer = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank * 2
    return per_layer * kv_layers(cfg)


def kv_layers(cfg: ModelConfig) -> int:
    return cfg.num_hidden_layers + cfg.num_nextn_predict_layers


def kv_bytes_per_token(
    cfg: ModelConfig, kv_cache_dtype: KVCacheDType, attention_backend: str = "flashinfer"
) -> int:
    """Every KV layer's 576-value latent for one token: bf16, or e4m3 plus a float32 scale
    per token, or e4m3 alone (half the bf16 bytes) where ``attention_backend`` reads an fp8
    pool with one scale per layer (``flashmla``)."""
    dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    token_scales = attention_backend_class(attention_backend, dtype).fp8_scales == "token"
    return bytes_per_page(kv_layers(cfg), 1, dtype, cfg.kv_cache_dim, token_scales)


def reserves(s: PlanSettings, world_size: int) -> tuple[int, int]:
    """(CUDA-graph reserve, activation reserve) in bytes, from the constants above."""
    graph = 0 if s.disable_cuda_graph else s.cuda_graph_max_bs * GRAPH_BYTES_PER_BS
    collective = COLLECTIVE_RESERVE_BYTES if world_size > 1 else 0
    return graph, s.chunked_prefill_size * ACTIVATION_BYTES_PER_PREFILL_TOKEN + collective


def min_kv_tokens(s: PlanSettings) -> int:
    """The floor: one prefill chunk beside one page per graphed decode row (less and one
    full scheduler step cannot run), or one whole ``context_length`` request if larger."""
    floor = s.chunked_prefill_size + s.cuda_graph_max_bs * s.page_size
    return max(floor, s.context_length or 0)


def plan(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    gpu_memory_gb: float,
    mem_fraction_static: float = 0.85,
    page_size: int = 64,
    kv_cache_dtype: KVCacheDType = "auto",
    cuda_graph_max_bs: int = 64,
    **more: Unpack[PlanExtras],
) -> Plan:
    """Each rank's bytes and the KV capacity of ``parallel`` on GPUs of ``gpu_memory_gb``.

    ``more``: the other :class:`PlanSettings` fields (``disable_cuda_graph``,
    ``chunked_prefill_size``, ``context_length``). Raises ``LayoutError`` for a layout the
    model cannot be split into, :class:`PlanError` (with the numbers and the plan) for one
    whose weights and reserves exceed the static budget or leave less KV than the floor.
    """
    settings = PlanSettings(
        gpu_memory_gb, mem_fraction_static, page_size, kv_cache_dtype, cuda_graph_max_bs, **more
    )
    check_model(parallel, model_cfg)
    infos, skip = checkpoint_infos(model_cfg), nextn_shared_names(model_cfg)
    ranks = tuple(
        rank_plan(infos, RankLayout(parallel, r), model_cfg, skip)
        for r in range(parallel.world_size)
    )
    graph, activation = reserves(settings, parallel.world_size)
    per_token = kv_bytes_per_token(model_cfg, kv_cache_dtype, settings.attention_backend)
    deepep = planned_deepep(model_cfg, parallel, settings.max_running_requests)
    draft = Plan(parallel, settings, ranks, graph, activation, per_token, 0, 0, deepep)
    result = dataclasses.replace(
        draft, kv_tokens=_kv_tokens(draft), min_kv_tokens=min_kv_tokens(settings)
    )
    check_fits(result)
    return result


def _kv_tokens(p: Plan) -> int:
    """Whole pages of what the budget leaves after :attr:`Plan.fixed_bytes`."""
    free = max(0, p.budget_bytes - p.fixed_bytes)
    page_bytes = p.kv_bytes_per_token * p.settings.page_size
    return free // page_bytes * p.settings.page_size


def check_fits(p: Plan) -> None:
    """Refuse a plan whose fixed bytes pass the budget or whose KV is below the floor."""
    s, w = p.settings, p.worst
    budget = (
        f"{p.budget_bytes / GB:.1f} GB (gpu_memory_gb {s.gpu_memory_gb:g} x "
        f"mem_fraction_static {s.mem_fraction_static:g})"
    )
    if p.fixed_bytes > p.budget_bytes:
        raise PlanError(
            f"layout {describe(p.parallel)} does not fit: rank {w.rank} needs weights "
            f"{w.weights_total / GB:.1f} GB + absorbed MLA {w.absorbed_mla_bytes / GB:.1f} GB + "
            f"CUDA-graph reserve {p.graph_reserve_bytes / GB:.1f} GB + activation reserve "
            f"{p.activation_reserve_bytes / GB:.1f} GB{_deepep_part(p)} = "
            f"{p.fixed_bytes / GB:.1f} GB > {budget}, before any KV cache{_deepep_hint(p)}",
            p,
        )
    if p.kv_tokens < p.min_kv_tokens:
        raise PlanError(
            f"layout {describe(p.parallel)} does not fit: rank {w.rank} keeps "
            f"{p.fixed_bytes / GB:.1f} GB of {budget} for weights and reserves"
            f"{_deepep_share(p)}, "
            f"leaving a KV cache of {p.kv_tokens} tokens ({p.kv_bytes_per_token} bytes per "
            f"token), below the {p.min_kv_tokens} tokens needed ({_floor_reason(s)})"
            f"{_deepep_hint(p)}",
            p,
        )


def _deepep_part(p: Plan) -> str:
    return "" if p.deepep is None else f" + DeepEP buffers {p.deepep_bytes / GB:.1f} GB"


def _deepep_share(p: Plan) -> str:
    return "" if p.deepep is None else f" (DeepEP buffers {p.deepep_bytes / GB:.1f} GB of it)"


def _deepep_hint(p: Plan) -> str:
    """Which field shrinks DeepEP's share, when it is the part that tips the plan over."""
    if p.deepep is None or p.fixed_bytes - p.deepep_bytes > p.budget_bytes:
        return ""
    low = p.deepep.rdma + p.deepep.activations
    return (
        f"; DeepEP's low-latency buffers take {low / GB:.1f} GB, sized by "
        f"max_running_requests {p.settings.max_running_requests} per rank: lower it "
        "(or use deepep_mode normal, or more GPUs)"
    )


def _floor_reason(s: PlanSettings) -> str:
    chunk = s.chunked_prefill_size + s.cuda_graph_max_bs * s.page_size
    if s.context_length and s.context_length > chunk:
        return f"one request of context_length {s.context_length}"
    return (
        f"chunked_prefill_size {s.chunked_prefill_size} + cuda_graph_max_bs "
        f"{s.cuda_graph_max_bs} x page_size {s.page_size}"
    )


def describe(p: ParallelConfig) -> str:
    """A layout in SGLang's flag terms, e.g. ``tp 8, dp 8 (dp attention), ep 8``."""
    parts = [f"tp {p.tp_size}"]
    if p.enable_dp_attention:
        parts.append(f"dp {p.dp_size} (dp attention)")
    parts.append(f"ep {p.ep_size}")
    if p.moe_dense_tp_size == 1:
        parts.append("moe-dense-tp 1")
    if p.enable_dp_lm_head:
        parts.append("dp lm_head")
    return ", ".join(parts)
