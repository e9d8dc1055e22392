"""One EP rank's share of DeepSeek-V3 on one device, FOR TIMING ONLY: layout, loopback parts,
KV sizing and the build.

Rank ``rank`` of DP-attention + EP over ``n`` ranks (``enable_dp_lm_head``: the whole
``lm_head`` stays on the rank, no gather) is built on one device with
:class:`~dsv3serve.parallel.comm_loopback.LoopbackTimingOnlyComm` and the same-rank
:class:`~dsv3serve.parallel.dispatch_loopback.LoopbackTimingOnlyDispatcher` (wrapped in a
:class:`RoutingRecorder`), so decode steps can be captured into CUDA graphs. Its outputs are
not the model's: every token's experts on other ranks are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from dsv3serve.bench.model.batches import seq_stride
from dsv3serve.bench.model.setup import BENCH_PRESETS
from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.group.rank_parts import RankParts
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.kvcache.pool import bytes_per_page
from dsv3serve.parallel.comm_loopback import LoopbackTimingOnlyComm
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.dispatch import create_dispatcher
from dsv3serve.parallel.dispatch_base import Dispatched, Dispatcher
from dsv3serve.parallel.shard import RankLayout
from dsv3serve.plan.planner import RankPlan, checkpoint_infos, nextn_shared_names, rank_plan

LOOPBACK_LABEL = "dispatch/combine: same-rank loopback (timing only)"
EP_LAYOUTS = {"ep2": 2, "ep4": 4, "ep8": 8, "ep16": 16}
KVChoiceName = Literal["pick", "auto", "fp8_e4m3"]


def ep_parallel(ranks: int) -> ParallelConfig:
    """DP attention + EP over ``ranks`` ranks with the whole lm_head on every rank."""
    return ParallelConfig(
        tp_size=ranks,
        dp_size=ranks,
        enable_dp_attention=True,
        ep_size=ranks,
        enable_dp_lm_head=True,
    )


def ep_model_config(preset: str) -> ModelConfig:
    """The bench preset (``full``: the published 61 layers, 256 experts) without NextN."""
    if preset not in BENCH_PRESETS:
        raise ValueError(f"unknown bench preset {preset!r}; known: {sorted(BENCH_PRESETS)}")
    return ModelConfig.from_dict({**BENCH_PRESETS[preset], "num_nextn_predict_layers": 0})


def planned_rank(cfg: ModelConfig, layout: RankLayout) -> RankPlan:
    """The memory planner's bytes of this rank (weights by kind, absorbed MLA apart)."""
    infos, skip = checkpoint_infos(cfg), nextn_shared_names(cfg)
    return rank_plan(infos, layout, cfg, skip)


class RoutingRecorder(Dispatcher):
    """Bench-only pass-through to a graph-safe dispatcher; while ``recording`` it keeps each
    dispatch's global ``topk_ids`` [T, K] (one entry per MoE layer, in layer order)."""

    graph_safe: ClassVar[bool] = True

    def __init__(self, inner: Dispatcher) -> None:
        if not inner.graph_safe:
            raise ValueError(f"expected a graph-safe dispatcher, found {type(inner).__name__}")
        self.inner = inner
        self.num_local_experts = inner.num_local_experts
        self.recording = False
        self.calls: list[Tensor] = []

    def dispatch(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Dispatched:
        if self.recording:
            self.calls.append(topk_ids.detach().clone())
        return self.inner.dispatch(x, topk_ids, topk_weights)

    def combine(self, y: Tensor, dispatched: Dispatched) -> Tensor:
        return self.inner.combine(y, dispatched)


def loopback_parts(layout: RankLayout, num_experts: int) -> tuple[RankParts, RoutingRecorder]:
    """Rank parts with the timing-only loopbacks, and the recorder inside them."""
    inner = create_dispatcher(layout.parallel, num_experts, layout.rank, loopback=True)
    recorder = RoutingRecorder(inner)
    comm = LoopbackTimingOnlyComm(layout.world_size, layout.rank)
    return RankParts(layout, comm, recorder), recorder


@dataclass(frozen=True)
class KVChoice:
    """The KV pool: dtype name, slots, and the context each batch size runs at."""

    kv_cache_dtype: Literal["auto", "fp8_e4m3"]
    kv_tokens: int
    contexts: dict[int, int]
    reason: str
    capped: list[int] = field(default_factory=list)  # batch sizes below the asked context


def kv_token_bytes(cfg: ModelConfig, kv_cache_dtype: str, compute: torch.dtype) -> int:
    """Pool bytes of one token over every KV layer (fp8: e4m3 + a float32 scale)."""
    dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else compute
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return bytes_per_page(layers, 1, dtype, cfg.kv_cache_dim)


def fit_context(batch_size: int, context: int, page: int, tokens: int) -> int:
    """``context``, or the longest page-aligned one whose ``batch_size`` sequences (plus the
    decoded token) fit in ``tokens`` slots; 0 when not even one page each fits."""
    if batch_size * seq_stride(context, 1, page) <= tokens:
        return context
    return max(0, (tokens // batch_size) // page * page - 1)


def choose_kv(
    cfg: ModelConfig,
    batch_sizes: list[int],
    context: int,
    page: int,
    room_bytes: int,
    want: KVChoiceName,
    compute: torch.dtype,
) -> KVChoice:
    """The KV pool for ``batch_sizes`` x ``context`` in ``room_bytes``.

    ``pick``: the compute dtype if every batch fits at ``context``, else e4m3 (half the
    bytes); a batch that does not fit either way runs at a shorter context (listed in
    ``capped``). Nothing is allocated here.
    """
    names: list[Literal["auto", "fp8_e4m3"]] = ["auto", "fp8_e4m3"] if want == "pick" else [want]
    need = max(b * seq_stride(context, 1, page) for b in batch_sizes)
    for name in names:
        per_token = kv_token_bytes(cfg, name, compute)
        if room_bytes // per_token >= need:
            why = f"{need} slots x {per_token} B = {need * per_token / 1e9:.1f} GB fit"
            return KVChoice(name, need, dict.fromkeys(batch_sizes, context), why)
    return _capped(cfg, batch_sizes, context, page, room_bytes, names[-1], compute)


def _capped(
    cfg: ModelConfig,
    batch_sizes: list[int],
    context: int,
    page: int,
    room_bytes: int,
    name: Literal["auto", "fp8_e4m3"],
    compute: torch.dtype,
) -> KVChoice:
    per_token = kv_token_bytes(cfg, name, compute)
    tokens = room_bytes // per_token
    contexts = {b: fit_context(b, context, page, tokens) for b in batch_sizes}
    if min(contexts.values()) < page:
        raise ValueError(
            f"expected room for {max(batch_sizes)} sequences of at least {page} tokens in the "
            f"KV pool, found {room_bytes / 1e9:.2f} GB = {tokens} slots of {per_token} B"
        )
    used = max(b * seq_stride(c, 1, page) for b, c in contexts.items())
    capped = [b for b, c in contexts.items() if c < context]
    why = f"{room_bytes / 1e9:.1f} GB holds {tokens} slots: batches {capped} capped"
    return KVChoice(name, used, contexts, why, capped)


@dataclass(frozen=True)
class BuildSpec:
    """What to build: device, backends, page size, graphs and the largest batch."""

    device: str
    attention_backend: str
    moe_backend: str
    page_size: int
    max_batch_size: int
    cuda_graphs: bool


def ep_engine_config(parallel: ParallelConfig, spec: BuildSpec, kv: KVChoice) -> EngineConfig:
    """The engine config of the rank: dummy weights, explicit KV slots, graphs to the batch."""
    layout: dict[str, Any] = parallel.model_dump(include={"tp_size", "dp_size", "ep_size"})
    return EngineConfig(
        model="bench-ep-rank",
        load_format="dummy",
        device=spec.device,
        enable_prefix_caching=False,
        enable_dp_attention=True,
        enable_dp_lm_head=True,
        **layout,
        page_size=spec.page_size,
        num_kv_tokens=kv.kv_tokens,
        kv_cache_dtype=kv.kv_cache_dtype,
        mem_fraction_static=0.99,  # the planner's check only; the KV size is explicit
        cuda_graph_max_bs=spec.max_batch_size,
        max_running_requests=spec.max_batch_size,
        disable_cuda_graph=not spec.cuda_graphs,
    ).model_copy(
        update={"attention_backend": spec.attention_backend, "moe_backend": spec.moe_backend}
    )


def build_rank(
    cfg: ModelConfig, layout: RankLayout, spec: BuildSpec, kv: KVChoice
) -> tuple[ModelRunner, RoutingRecorder]:
    """The rank's runner over loopback parts (dummy FP8 weights drawn on the device)."""
    parts, recorder = loopback_parts(layout, cfg.n_routed_experts)
    engine_cfg = ep_engine_config(layout.parallel, spec, kv)
    return ModelRunner(engine_cfg, None, cfg, parts=parts), recorder
