"""DeepSeek-V3 decoder: MLA attention, MoE and dense MLPs, and the NextN (MTP) layer.

No kernel code lives here: attention goes through an :class:`AttentionBackend`, routed
experts through a :class:`MoEBackend`, linears through :mod:`dsv3serve.layers.linear`.
Parameter names follow the published checkpoints (``model.layers.3.self_attn.q_a_proj``),
so loading is a name lookup; only the stacked experts and the NextN layer map names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from dsv3serve.attention.base import AttentionBackend
from dsv3serve.config import ModelConfig
from dsv3serve.eplb.state import EplbState
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.kernels.mla_norm import mla_kernels_apply, qkv_a_rmsnorm
from dsv3serve.kernels.norm_quant import NormQuantOut, add_rmsnorm_quant
from dsv3serve.layers.fused import can_pack, pack_rows
from dsv3serve.layers.linear import Linear
from dsv3serve.layers.load_target import LoadTarget
from dsv3serve.layers.norm import RMSNorm
from dsv3serve.layers.rotary import RotaryEmbedding
from dsv3serve.layers.vocab_parallel import logits_mode, vocab_parallel_logits
from dsv3serve.model.sharding import Sharding, part_sharding
from dsv3serve.moe import create_moe_backend
from dsv3serve.moe.base import MoEBackend
from dsv3serve.moe.experts import FusedExperts
from dsv3serve.moe.sharded import (
    fusion_blocked_reason,
    held_experts,
    run_dispatched,
    to_local_ids,
)
from dsv3serve.moe.shared import (
    SharedFusion,
    append_shared_expert,
    fusable_reason,
    fusion_max_tokens,
    packs_shared,
    tie_shared_expert,
)
from dsv3serve.parallel.comm import Comm, SingleRank
from dsv3serve.parallel.dispatch_base import Dispatcher
from dsv3serve.parallel.shard import RankLayout, check_model
from dsv3serve.parallel.uniform import uniform_real_tokens
from dsv3serve.settings import Settings

AttnImpl = Literal["auto", "mha", "absorb"]


@dataclass(frozen=True)
class ModelOptions:
    """How to build the model: compute dtype, MLA form, FP8 activation quantisation, MoE."""

    dtype: torch.dtype = torch.bfloat16
    attn_impl: AttnImpl = "auto"  # auto: MHA for prefill/extend, absorbed MQA for decode
    fp8_act_quant: bool = True
    moe_backend: str = "torch"
    shared_experts_fusion: SharedFusion = "auto"  # see dsv3serve.moe.shared
    layout: RankLayout | None = None  # this rank's parallel layout; None: one rank, all whole
    # fused residual add + RMSNorm + FP8 quantisation where the FP8 kernels run (see
    # DecoderLayer); default from $DSV3SERVE_FUSED_NORM_QUANT (on unless 0/false/off/no)
    fuse_norm_quant: bool = field(default_factory=lambda: Settings.from_env().fused_norm_quant)
    # the MLA fusions where the Triton kernels run (see MLAttention): the q/kv norms of the
    # down-projection in one kernel, RoPE inside the KV-cache write; from $DSV3SERVE_FUSED_MLA
    fuse_mla: bool = field(default_factory=lambda: Settings.from_env().fused_mla)


@dataclass
class StepContext:
    """Per-step values shared by all layers (computed once per forward)."""

    batch: ForwardBatch
    attn: AttentionBackend
    cos: torch.Tensor
    sin: torch.Tensor
    absorbed: bool


class DenseMLP(nn.Module):
    """SiLU-gated MLP (dense layers and the shared expert).

    Under TP gate/up hold this rank's rows of ``inter`` and down its columns; the partial
    output is all-reduced here, or (``reduce=False``) left to the owner to sum with its own.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        inter: int,
        opts: ModelOptions,
        shard: Sharding | None = None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        h, dt, aq = cfg.hidden_size, opts.dtype, opts.fp8_act_quant
        self.shard = part_sharding(opts.layout, shard)
        lin = self.shard.linear
        self.gate_proj = lin(cfg, f"{prefix}.gate_proj", h, inter, dt, aq)
        self.up_proj = lin(cfg, f"{prefix}.up_proj", h, inter, dt, aq)
        self.down_proj = lin(cfg, f"{prefix}.down_proj", inter, h, dt, aq)
        self.partial = self.shard.row_parallel(cfg, f"{prefix}.down_proj")
        self.reduce = reduce and self.partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._down(self.gate_proj(x), self.up_proj(x))

    def forward_quantized(self, xq: NormQuantOut) -> torch.Tensor:
        """``forward`` over input already quantised (where :meth:`takes_quantized`): gate and
        up read the one quantised copy."""
        gate = self.gate_proj.forward_quantized(xq.q, xq.scale)
        return self._down(gate, self.up_proj.forward_quantized(xq.q, xq.scale))

    def takes_quantized(self, device: torch.device, dtype: torch.dtype) -> bool:
        return all(lin.takes_quantized(device, dtype) for lin in (self.gate_proj, self.up_proj))

    def _down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(gate) * up)
        return self.shard.comm.all_reduce(y) if self.reduce else y


class MoEGate(nn.Module):
    """Router weights: ``weight`` [E, H] (bf16) and ``e_score_correction_bias`` [E] (fp32)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        e, h = cfg.n_routed_experts, cfg.hidden_size
        self.weight = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False)
        bias = torch.zeros(e, dtype=torch.float32)
        self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)


class MoE(nn.Module):
    """Routed experts chosen by the biased grouped top-k, plus the shared expert.

    With shared-expert fusion the shared expert's weights live in slot E of the expert stack
    (its ``shared_experts`` linears are views of it) and, at token counts where fusion is on,
    it runs in the routed launches as expert E with weight 1.

    Sharded (``opts.layout``): the router is replicated. Under TP the rank runs its experts
    (its EP range, or its slice of every expert) on all tokens and its shared-expert slice;
    the two partials take ONE all-reduce. Under DP attention with EP the rank's own tokens go
    through the dispatcher to their experts and back; the shared expert runs whole locally.
    """

    def __init__(
        self, cfg: ModelConfig, prefix: str, opts: ModelOptions, shard: Sharding | None = None
    ) -> None:
        super().__init__()
        self.cfg, self.fusion = cfg, opts.shared_experts_fusion
        self.moe_backend = opts.moe_backend
        self.shard = part_sharding(opts.layout, shard)
        self.gate = MoEGate(cfg, opts.dtype)
        fp8 = cfg.quant_method == "fp8"
        shared_inter = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = DenseMLP(
            cfg, f"{prefix}.shared_experts", shared_inter, opts, self.shard, reduce=False
        )
        slots = 1 if self._packs_shared(cfg, fp8) else 0
        held, inter = held_experts(cfg, prefix, opts.layout, fp8)
        self.eplb = self.shard.eplb
        self.eplb_row = 0 if self.eplb is None else self.eplb.row_of(prefix)
        stack = len(held) if self.eplb is None else self.eplb.slots_per_rank
        self.experts = FusedExperts(
            stack, cfg.hidden_size, inter, fp8, opts.dtype, slots, held.start, len(held)
        )
        self.masks_ids = not self.shard.dispatches and len(held) < cfg.n_routed_experts
        experts_partial = self.masks_ids or inter < cfg.moe_intermediate_size
        self.reduce = self.shared_experts.partial or experts_partial
        if slots:
            self.tie_shared()
        self.backend: MoEBackend = create_moe_backend(opts.moe_backend, opts.fp8_act_quant)
        self.route = self.backend.route  # e.g. the Triton backend's fused gate kernel
        self._fuse_max_tokens: int | None = None  # resolved on the first forward's device
        self.logits_in_gemm = False  # decided by plan_fusion(), once the weights are in place

    def _packs_shared(self, cfg: ModelConfig, fp8: bool) -> bool:
        blocked = fusion_blocked_reason(self.shard.layout)
        if blocked is not None and self.fusion == "on":
            raise ValueError(f"shared_experts_fusion 'on': {blocked}")
        if blocked is not None or not packs_shared(self.fusion, self.moe_backend):
            return False
        reason = fusable_reason(cfg.n_shared_experts, self.shared_experts.down_proj.is_fp8, fp8)
        if reason is not None and self.fusion == "on":
            raise ValueError(f"shared_experts_fusion 'on': {reason}")
        return reason is None

    def tie_shared(self) -> None:
        """Point the shared expert's weights at slot E of the stack (copying them there)."""
        mlp = self.shared_experts
        parts = [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        scales = [p.weight_scale_inv for p in parts if p.weight_scale_inv is not None]
        tie_shared_expert(self.experts, [p.weight for p in parts], scales)

    def fuses_shared(self, x: torch.Tensor) -> bool:
        """Whether this batch runs the shared expert inside the fused MoE."""
        if not self.experts.shared_slots:
            return False
        if self._fuse_max_tokens is None:
            self._fuse_max_tokens = fusion_max_tokens(
                self.fusion, self.moe_backend, self.experts, x.device
            )
        return x.shape[0] <= self._fuse_max_tokens

    def plan_fusion(self, device: torch.device, dtype: torch.dtype) -> None:
        """Decide whether the router logits come from one bf16 GEMM that writes float32 (CUDA,
        bf16 activations: the products of two bf16 values are exact in float32 and the
        GEMM accumulates in float32, as the reference does) instead of casting ``x`` and the
        [E, H] router weight to float32 every step; elsewhere the reference casts."""
        self.logits_in_gemm = device.type == "cuda" and dtype == torch.bfloat16

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [T, E] router logits of ``x`` [T, H]."""
        if self.logits_in_gemm:
            return torch.mm(x, self.gate.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.gate.weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        logits = self.router_logits(x)
        weights, ids = self.route(
            logits,
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.routed_scaling_factor,
            c.norm_topk_prob,
        )
        if self.fuses_shared(x):
            weights, ids = append_shared_expert(weights, ids, c.n_routed_experts)
            return self.backend.forward(x, weights, ids, self.experts, with_shared=True)
        out = self._routed(x, weights, ids) + self.shared_experts(x)
        return self.shard.comm.all_reduce(out) if self.reduce else out

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's routed-expert output for ``x`` (a partial sum under TP)."""
        if self.shard.dispatches:
            dispatcher = self.shard.dispatcher
            assert dispatcher is not None
            if self.eplb is not None:  # logical -> physical ids, counted (not the padding)
                ids = self.eplb.route(self.eplb_row, ids, uniform_real_tokens(ids.shape[0]))
            return run_dispatched(dispatcher, self.backend, x, weights, ids, self.experts)
        if self.masks_ids:
            weights, ids = to_local_ids(weights, ids, self.experts.expert_ids)
        return self.backend.forward(x, weights, ids, self.experts)


class MLAttention(nn.Module):
    """Multi-head latent attention with both the MHA and the weight-absorbed MQA forms.

    Where the Triton kernels run (CUDA, bf16 compute; decided once by :meth:`plan_fusion`)
    and ``opts.fuse_mla`` is on, the queries and the cache rows come from two kernels in
    place of the norms, rotations, concatenation and cache scatter: the q/kv norms of the
    down-projection's output (:func:`qkv_a_rmsnorm`, which also quantises q for an FP8
    ``q_b_proj``) and RoPE inside the KV-cache write
    (:meth:`AttentionBackend.save_latent_roped`). Elsewhere the reference ops run.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        layer_id: int,
        opts: ModelOptions,
        shard: Sharding | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.layer_id, self.dtype = cfg, layer_id, opts.dtype
        self.shard = part_sharding(opts.layout, shard)
        h, heads, dt, aq = cfg.hidden_size, cfg.num_attention_heads, opts.dtype, opts.fp8_act_quant
        qk, lin = heads * cfg.qk_head_dim, self.shard.linear
        if cfg.q_lora_rank:
            self.q_a_proj = lin(cfg, f"{prefix}.q_a_proj", h, cfg.q_lora_rank, dt, aq)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dt)
            self.q_b_proj = lin(cfg, f"{prefix}.q_b_proj", cfg.q_lora_rank, qk, dt, aq)
        else:
            self.q_proj = lin(cfg, f"{prefix}.q_proj", h, qk, dt, aq)
        self.kv_a_proj_with_mqa = lin(
            cfg, f"{prefix}.kv_a_proj_with_mqa", h, cfg.kv_cache_dim, dt, aq
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dt)
        kv_b_out = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = lin(cfg, f"{prefix}.kv_b_proj", cfg.kv_lora_rank, kv_b_out, dt, aq)
        self.o_proj = lin(cfg, f"{prefix}.o_proj", heads * cfg.v_head_dim, h, dt, aq)
        # heads on this rank (all of them, or heads / attn_tp): from kv_b_proj's local rows
        self.heads = self.kv_b_proj.out_features // (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.reduce = self.shard.row_parallel(cfg, f"{prefix}.o_proj")
        self.w_uk: torch.Tensor | None = None  # [H, nope, R], set by post_load()
        self.w_uv: torch.Tensor | None = None  # [H, v, R]
        self.qkv_a_proj: Linear | None = None  # q_a_proj + kv_a_proj_with_mqa, by post_load()
        self.fuse_mla = opts.fuse_mla
        self.fuses_mla = False  # decided by plan_fusion(), once the weights are in place
        self.q_b_quantized = False  # the fused q norm writes FP8 for q_b_proj

    def post_load(self) -> None:
        """Pack q_a_proj with kv_a_proj_with_mqa (one GEMM over x, N = 1536 + 576 in
        DeepSeek-V3) and split the (dequantised) kv_b_proj into W_UK and W_UV."""
        c = self.cfg
        parts = [self.q_a_proj, self.kv_a_proj_with_mqa] if c.q_lora_rank else []
        packed = pack_rows(parts) if parts and can_pack(parts) else None
        # Not registered as a submodule: its storage is the parts' (views), and the
        # checkpoint names, state dict and draft requantisation keep seeing the parts.
        object.__setattr__(self, "qkv_a_proj", packed)
        w = self.kv_b_proj.dequantized_weight(self.dtype)
        w = w.view(self.heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        self.w_uk = w[:, : c.qk_nope_head_dim].contiguous()
        self.w_uv = w[:, c.qk_nope_head_dim :].contiguous()

    def plan_fusion(self, device: torch.device, dtype: torch.dtype) -> None:
        """Decide, for activations of ``dtype`` on ``device``, whether ``forward`` runs the
        fused MLA kernels and whether the fused q norm quantises for ``q_b_proj``."""
        fused = self.fuse_mla and bool(self.cfg.q_lora_rank) and mla_kernels_apply(device, dtype)
        self.fuses_mla = fused
        self.q_b_quantized = fused and self.q_b_proj.takes_quantized(device, dtype)

    def takes_quantized(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether ``forward`` can read its input quantised: every FP8 GEMM that reads ``x``
        (the packed q/kv down-projection, or its parts) runs the FP8 kernels for it."""
        return all(lin.takes_quantized(device, dtype) for lin in self._x_readers())

    def _x_readers(self) -> list[Linear]:
        """The linears that read the layer input: the packed q/kv down-projection, or the
        query's first projection and the KV down-projection."""
        if self.qkv_a_proj is not None:
            return [self.qkv_a_proj]
        first = self.q_a_proj if self.cfg.q_lora_rank else self.q_proj
        return [first, self.kv_a_proj_with_mqa]

    def _down_proj(
        self, x: torch.Tensor, xq: NormQuantOut | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query's first projection [T, q_lora_rank] (or the query [T, H*192] without
        one) and the compressed KV [T, 576] of the new tokens (views of one packed GEMM's
        output where the two are packed)."""
        c = self.cfg
        outs = [
            lin(x) if xq is None else lin.forward_quantized(xq.q, xq.scale)
            for lin in self._x_readers()
        ]
        if len(outs) == 2:
            return outs[0], outs[1]
        q_a, kv_a = outs[0].split([c.q_lora_rank, c.kv_cache_dim], -1)
        return q_a, kv_a

    def _split_heads(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query [T, H*192] -> q_nope [T, H, 128] and q_pe [T, H, 64] (views)."""
        c = self.cfg
        q_nope, q_pe = q.view(q.shape[0], self.heads, c.qk_head_dim).split(
            [c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1
        )
        return q_nope, q_pe

    def _queries(
        self, x: torch.Tensor, ctx: StepContext, xq: NormQuantOut | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [T, H, 128] and the rotated q_pe [T, H, 64]; saves the new tokens' cache
        rows ``[kv_a_layernorm(c_kv) | rope(k_pe)]`` on the way (reference ops)."""
        c = self.cfg
        q_a, kv_a = self._down_proj(x, xq)
        q = self.q_b_proj(self.q_a_layernorm(q_a)) if c.q_lora_rank else q_a
        q_nope, q_pe = self._split_heads(q)
        q_pe = RotaryEmbedding.rotate(q_pe, ctx.cos, ctx.sin)
        kv_c, k_pe = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        k_pe = RotaryEmbedding.rotate(k_pe, ctx.cos, ctx.sin)
        ctx.attn.save_latent(self.layer_id, torch.cat([self.kv_a_layernorm(kv_c), k_pe], -1))
        return q_nope, q_pe

    def _queries_fused(
        self, x: torch.Tensor, ctx: StepContext, xq: NormQuantOut | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_queries` through the fused kernels (where :attr:`fuses_mla`)."""
        q_a, kv_a = self._down_proj(x, xq)
        qn, kvn = self.q_a_layernorm, self.kv_a_layernorm
        quant = self.q_b_quantized
        normed = qkv_a_rmsnorm(q_a, kv_a, qn.weight, kvn.weight, qn.eps, kvn.eps, quant)
        if quant:
            q = self.q_b_proj.forward_quantized(normed.q, normed.scale)
        else:
            q = self.q_b_proj(normed.q)
        q_nope, q_pe = self._split_heads(q)
        q_pe = ctx.attn.save_latent_roped(self.layer_id, normed.latent, q_pe, ctx.cos, ctx.sin)
        return q_nope, q_pe

    def expand_kv(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents [S, 576] -> keys [S, H, 192] and values [S, H, 128]."""
        c = self.cfg
        s, heads = latent.shape[0], self.heads
        kv = self.kv_b_proj(latent[:, : c.kv_lora_rank]).view(s, heads, -1)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_pe = latent[:, None, c.kv_lora_rank :].expand(s, heads, c.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def forward(
        self, x: torch.Tensor, ctx: StepContext, xq: NormQuantOut | None = None
    ) -> torch.Tensor:
        """``xq``: ``x`` already quantised (only where :meth:`takes_quantized`)."""
        c = self.cfg
        t, heads = x.shape[0], self.heads
        queries = self._queries_fused if self.fuses_mla else self._queries
        q_nope, q_pe = queries(x, ctx, xq)
        if ctx.absorbed:
            q_latent = torch.einsum("thd,hdr->thr", q_nope, self.w_uk)
            o_latent = ctx.attn.forward_absorbed(q_latent, q_pe, self.layer_id, c.softmax_scale)
            out = torch.einsum("thr,hvr->thv", o_latent, self.w_uv)
        else:
            q_full = torch.cat([q_nope, q_pe], dim=-1)
            out = ctx.attn.forward_mha(q_full, self.layer_id, c.softmax_scale, self.expand_kv)
        out = self.o_proj(out.reshape(t, heads * c.v_head_dim))
        return self.shard.comm.all_reduce(out) if self.reduce else out


class DecoderLayer(nn.Module):
    """Pre-norm block: MLA then a dense MLP (first ``first_k_dense_replace`` layers) or MoE."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        prefix: str,
        opts: ModelOptions,
        shard: Sharding | None = None,
    ) -> None:
        super().__init__()
        self.fuse_norm_quant = opts.fuse_norm_quant
        self.fuses_norm_quant = False  # decided by plan_fusion(), once the weights are in place
        self.dense_quantized = False  # the post-attention norm quantises for a dense MLP
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.dtype)
        self.self_attn = MLAttention(cfg, f"{prefix}.self_attn", layer_id, opts, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.dtype)
        self.mlp: MoE | DenseMLP
        if cfg.is_moe_layer(layer_id):
            self.mlp = MoE(cfg, f"{prefix}.mlp", opts, shard)
        else:
            self.mlp = DenseMLP(cfg, f"{prefix}.mlp", cfg.intermediate_size, opts, shard)

    def plan_fusion(self) -> None:
        """Decide once, for the compute dtype on the weights' device, which fused kernels
        ``forward`` runs (call again after moving the weights or flipping a switch):
        :meth:`_forward_fused` where switched on and the attention's FP8 GEMM reads its input
        quantised (CUDA, Triton, bf16, FP8 weights), with the post-attention norm quantising
        for a dense MLP that reads FP8 too; the attention's own fusions
        (:meth:`MLAttention.plan_fusion`) and a MoE's router logits (:meth:`MoE.plan_fusion`).
        The CPU and float32 paths keep the reference ops.
        """
        weight = self.input_layernorm.weight
        device, dtype = weight.device, weight.dtype
        self.self_attn.plan_fusion(device, dtype)
        fused = self.fuse_norm_quant and self.self_attn.takes_quantized(device, dtype)
        self.fuses_norm_quant = fused
        mlp = self.mlp
        if isinstance(mlp, MoE):
            mlp.plan_fusion(device, dtype)
        self.dense_quantized = (
            fused and isinstance(mlp, DenseMLP) and mlp.takes_quantized(device, dtype)
        )

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.fuses_norm_quant:
            return self._forward_fused(x, ctx)
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _forward_fused(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The same block with each norm fused into one kernel: the input norm with the
        quantisation for the q/kv down-projection; the residual add with the post-attention
        norm, which also quantises for a dense MLP's gate and up GEMMs (a MoE reads bf16, so
        for it the kernel writes no FP8)."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        x = x.contiguous()  # the fused kernels read rows densely (a no-op for every caller now)
        attn = self.self_attn(x, ctx, add_rmsnorm_quant(x, None, n1.weight, n1.eps))
        dense_q = self.dense_quantized
        post = add_rmsnorm_quant(attn.contiguous(), x, n2.weight, n2.eps, not dense_q, dense_q)
        assert post.residual is not None
        mlp = self.mlp
        if dense_q and isinstance(mlp, DenseMLP):  # dense_q: plan_fusion found a DenseMLP
            return post.residual + mlp.forward_quantized(post)
        assert post.normed is not None
        return post.residual + self.mlp(post.normed)


class NextNLayer(nn.Module):
    """DeepSeek's MTP module: ``eh_proj([enorm(embed(t+1)) ; hnorm(h_t)])`` then one block.

    Stored in checkpoints as ``model.layers.{num_hidden_layers}.*``; its embedding and
    head are shared with the main model.
    """

    def __init__(self, cfg: ModelConfig, opts: ModelOptions, shard: Sharding | None = None) -> None:
        super().__init__()
        h, dt = cfg.hidden_size, opts.dtype
        prefix = f"model.layers.{cfg.num_hidden_layers}"
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dt)
        shard = part_sharding(opts.layout, shard)
        self.eh_proj = shard.linear(cfg, f"{prefix}.eh_proj", 2 * h, h, dt, opts.fp8_act_quant)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers, prefix, opts, shard)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps, dt)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Returns the pre-norm hidden state; apply ``shared_head_norm`` then the head."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.block(x, ctx)


class DeepseekV3ForCausalLM(nn.Module):
    """The full model; ``forward`` returns final hidden states, ``compute_logits`` the head.

    With ``opts.layout`` the model is one rank's shard: every parameter has its LOCAL shape
    (:func:`~dsv3serve.parallel.shard.placement_of`), ``comm`` is the group's collectives
    and ``dispatcher`` (DP attention with EP) moves tokens to their experts' ranks. A layout
    the model's dimensions cannot split into raises LayoutError here.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        opts: ModelOptions | None = None,
        comm: Comm | None = None,
        dispatcher: Dispatcher | None = None,
        eplb: EplbState | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.opts = cfg, opts or ModelOptions()
        self.fuse_norm_quant = self.opts.fuse_norm_quant  # also every other RMSNorm's switch
        dt, layout = self.opts.dtype, self.opts.layout
        if layout is not None:
            check_model(layout.parallel, cfg)
        shard = Sharding(layout, comm or SingleRank(), dispatcher, eplb)
        self.shard = shard
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dt)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, f"model.layers.{i}", self.opts, shard)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.lm_head = shard.linear(cfg, "lm_head", cfg.hidden_size, cfg.vocab_size, dt)
        self.logits_mode = logits_mode(layout)
        self.nextn = NextNLayer(cfg, self.opts, shard) if cfg.num_nextn_predict_layers else None
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        shard.check(cfg)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers``, typed (an ``nn.ModuleList`` gives its items as plain Modules)."""
        return cast("list[DecoderLayer]", list(self.layers))

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache: the decoder layers plus the NextN layer if present."""
        return self.cfg.num_hidden_layers + (1 if self.nextn is not None else 0)

    def post_load(self) -> None:
        """Derive run-time tensors (absorbed MLA weights) after weights are in place, and
        re-point fused shared experts at their stack slot (a device move copies them apart)."""
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.post_load()
            elif isinstance(module, MoE) and module.experts.shared_slots:
                module.tie_shared()
        self.set_fusions()

    def set_fusions(self, norm_quant: bool | None = None, mla: bool | None = None) -> None:
        """Switch the fused add + norm + quant path (``norm_quant``) or the MLA fusions
        (``mla``) of every decoder layer (None: leave it), then decide again where each runs
        (:meth:`DecoderLayer.plan_fusion`); ``norm_quant`` also switches every RMSNorm to its
        one-kernel form (:meth:`RMSNorm.plan_fusion`: the final norm, the MTP layer's three,
        and a layer's own where it runs unfused). ``post_load`` calls it with no switch."""
        if norm_quant is not None:
            self.fuse_norm_quant = norm_quant
        for module in self.modules():
            if isinstance(module, DecoderLayer):
                if norm_quant is not None:
                    module.fuse_norm_quant = norm_quant
                if mla is not None:
                    module.self_attn.fuse_mla = mla
                module.plan_fusion()
            elif isinstance(module, RMSNorm):  # those a fused layer does not replace
                module.plan_fusion(self.fuse_norm_quant)

    def step_context(
        self, batch: ForwardBatch, attn: AttentionBackend, planned: bool = False
    ) -> StepContext:
        """Plan the step once: attention metadata, rotary cos/sin and the MLA form.

        ``planned``: the caller already ran ``attn.plan`` (a CUDA graph replays the forward
        without the host-side planning, which happens before each replay).
        """
        if not planned:
            attn.plan(batch)
        cos, sin = self.rotary.cos_sin(batch.positions)
        impl = self.opts.attn_impl
        absorbed = impl == "absorb" or (impl == "auto" and batch.is_decode)
        return StepContext(batch, attn, cos, sin, absorbed)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, attn: AttentionBackend, planned: bool = False
    ) -> torch.Tensor:
        """Run the decoder over the batch's new tokens; returns normed hidden [T, H].

        A batch of 0 tokens runs :meth:`forward_idle` (no attention plan)."""
        if batch.num_tokens == 0:
            return self.forward_idle()
        ctx = self.step_context(batch, attn, planned)
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)

    @torch.inference_mode()
    def forward_idle(self) -> torch.Tensor:
        """A step with no tokens on this rank: joins the collectives of every decoder layer in
        order (under DP attention only the MoE layers have any: dispatch / combine, where
        this rank still runs its experts on tokens other ranks send). Returns hidden [0, H].
        """
        x = self.embed_tokens.weight.new_empty((0, self.cfg.hidden_size))
        for layer in self.layers:
            x = layer.mlp(x) if isinstance(layer.mlp, MoE) else x
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] in float32 for hidden states [N, H].

        With a vocab-parallel head this is collective (see
        :mod:`dsv3serve.layers.vocab_parallel`): every rank calls it each step, with 0 rows
        when it has none, and gets the full vocabulary for its own rows.
        """
        return vocab_parallel_logits(
            self.lm_head, hidden, self.shard.comm, self.logits_mode, self.cfg.vocab_size
        )

    def checkpoint_targets(self) -> dict[str, LoadTarget]:
        """Every checkpoint tensor name this model consumes, mapped to where it goes."""
        targets: dict[str, LoadTarget] = {}
        for name, module in self.named_modules():
            if isinstance(module, FusedExperts):
                targets.update(module.checkpoint_targets(_ckpt_name(self.cfg, name)))
        stacked = {
            id(p) for m in self.modules() if isinstance(m, FusedExperts) for p in m.parameters()
        }
        for name, param in self.named_parameters():
            if id(param) not in stacked:
                targets[_ckpt_name(self.cfg, name)] = LoadTarget(param)
        return targets

    def expert_stacks(self) -> list[list[torch.Tensor]]:
        """Each MoE layer's stacked expert tensors, by EPLB row (what rebalancing moves)."""
        moes = sorted((m for m in self.modules() if isinstance(m, MoE)), key=lambda m: m.eplb_row)
        return [m.experts.slot_tensors() for m in moes]

    def not_held_checkpoint_names(self) -> frozenset[str]:
        """Checkpoint tensors that belong to other ranks (routed experts outside this rank's
        EP range): expected in the checkpoint, not loaded here. Empty without EP."""
        names: set[str] = set()
        for name, module in self.named_modules():
            if isinstance(module, FusedExperts):
                names.update(_other_experts(_ckpt_name(self.cfg, name), module, self.cfg))
        return frozenset(names)

    def ignored_checkpoint_names(self) -> tuple[str, ...]:
        """Prefixes of checkpoint tensors that are present but deliberately not loaded."""
        mtp = f"model.layers.{self.cfg.num_hidden_layers}"
        if self.nextn is None:
            return (f"{mtp}.",)
        # The NextN copies of the embedding and head are shared with the main model.
        return (f"{mtp}.embed_tokens.", f"{mtp}.shared_head.head.")


def _other_experts(prefix: str, experts: FusedExperts, cfg: ModelConfig) -> list[str]:
    """Names of the routed-expert tensors of ``prefix`` that ``experts`` does not hold."""
    suffixes = ["weight", "weight_scale_inv"] if experts.is_fp8 else ["weight"]
    return [
        f"{prefix}.{e}.{proj}.{suffix}"
        for e in range(cfg.n_routed_experts)
        if e not in experts.expert_ids
        for proj in ("gate_proj", "up_proj", "down_proj")
        for suffix in suffixes
    ]


def _ckpt_name(cfg: ModelConfig, name: str) -> str:
    """Module path in this model -> tensor name in the published checkpoints."""
    mtp = f"model.layers.{cfg.num_hidden_layers}"
    if name.startswith("nextn."):
        rest = name[len("nextn.") :]
        if rest.startswith("block."):
            return f"{mtp}.{rest[len('block.') :]}"
        if rest.startswith("shared_head_norm."):
            return f"{mtp}.shared_head.norm.{rest[len('shared_head_norm.') :]}"
        return f"{mtp}.{rest}"
    if name.startswith("lm_head"):
        return name
    return f"model.{name}"
