"""The parallel layout of a worker group, with SGLang's field names, validated once.

A group is ``tp_size`` ranks (one per GPU). Two layouts are built:

* **TP** (``dp_size`` 1): attention heads, the dense MLP (unless ``moe_dense_tp_size`` is 1)
  and the shared expert are split over every rank, ``lm_head`` is vocab-parallel; the routed
  experts are split by EP (``ep_size == tp_size``) or, with ``ep_size`` 1, by their
  intermediate dimension. Every rank sees the same tokens.
* **DP attention** (``enable_dp_attention``, ``dp_size == tp_size``): every rank holds the
  attention and dense weights, its own requests and KV pool; the routed experts are split by
  EP and tokens travel to their experts' ranks and back (dispatch / combine).

Attention TP inside a DP rank (``1 < dp_size < tp_size``) is not built and is refused.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

A2ABackend = Literal["none", "deepep"]
DeepEPMode = Literal["auto", "normal", "low_latency"]


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message names the fields."""


class ParallelConfig(BaseModel):
    """How one engine spreads over the ranks of its group (SGLang's names and meanings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp_size: int = Field(1, ge=1, description="ranks in the group (one per GPU)")
    dp_size: int = Field(1, ge=1, description="DP-attention ranks (each its own requests)")
    enable_dp_attention: bool = False
    ep_size: int = Field(1, ge=1, description="ranks the routed experts are split over")
    moe_dense_tp_size: int | None = Field(None, description="1: dense MLP layers replicated")
    enable_dp_lm_head: bool = False
    moe_a2a_backend: A2ABackend = "none"
    deepep_mode: DeepEPMode = "auto"
    # EPLB (SGLang's names; docs/eplb.md): logical experts over physical slots
    enable_eplb: bool = False
    ep_num_redundant_experts: int = Field(0, ge=0, description="extra expert slots per layer")
    init_expert_location: str | None = Field(None, description="expert-load dump to place by")
    eplb_rebalance_num_iterations: int = Field(1000, ge=1, description="steps per rebalance")

    @property
    def world_size(self) -> int:
        """Ranks (processes, GPUs) in the group."""
        return self.tp_size

    @property
    def attn_tp_size(self) -> int:
        """Ranks one attention computation is split over."""
        return self.tp_size // self.dp_size if self.enable_dp_attention else self.tp_size

    @property
    def dense_tp_size(self) -> int:
        """Ranks a dense MLP layer (layers before ``first_k_dense_replace``) is split over."""
        return 1 if self.moe_dense_tp_size == 1 else self.attn_tp_size

    @property
    def moe_tp_size(self) -> int:
        """Ranks each routed expert's intermediate dimension is split over (TP without EP)."""
        return self.attn_tp_size if self.ep_size == 1 else 1

    @property
    def lm_head_tp_size(self) -> int:
        """Ranks the vocabulary of ``lm_head`` is split over.

        TP: all of them. DP attention: all of them (each rank's sampled hidden states are
        gathered first), or, with ``enable_dp_lm_head``, the attention TP group only (1 here:
        every rank holds the whole head and needs no gather).
        """
        if self.enable_dp_attention and self.enable_dp_lm_head:
            return self.attn_tp_size
        return self.tp_size

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        for check in (_check_dp, _check_ep, _check_dense, _check_a2a, _check_eplb):
            check(self)
        return self


def _check_dp(p: ParallelConfig) -> None:
    if p.tp_size % p.dp_size:
        raise LayoutError(f"dp_size {p.dp_size} must divide tp_size {p.tp_size}")
    if p.dp_size > 1 and not p.enable_dp_attention:
        raise LayoutError(
            f"dp_size {p.dp_size} needs enable_dp_attention (independent replicas of one "
            "engine are the deployment's num_replicas, not a group's dp_size)"
        )
    if p.enable_dp_attention and p.dp_size != p.tp_size:
        raise LayoutError(
            f"enable_dp_attention with dp_size {p.dp_size} and tp_size {p.tp_size}: "
            "attention TP inside a DP rank is not built; set dp_size = tp_size"
        )
    if p.enable_dp_lm_head and not p.enable_dp_attention:
        raise LayoutError("enable_dp_lm_head needs enable_dp_attention")


def _check_ep(p: ParallelConfig) -> None:
    if p.ep_size not in (1, p.tp_size):
        raise LayoutError(
            f"ep_size {p.ep_size} must be 1 or tp_size {p.tp_size} (experts are split over "
            "the ranks of the group)"
        )


def _check_dense(p: ParallelConfig) -> None:
    if p.moe_dense_tp_size not in (None, 1):
        raise LayoutError(
            f"moe_dense_tp_size {p.moe_dense_tp_size}: expected unset (dense layers split like "
            "attention) or 1 (replicated)"
        )


def _check_a2a(p: ParallelConfig) -> None:
    if p.moe_a2a_backend == "deepep" and p.ep_size == 1:
        raise LayoutError("moe_a2a_backend 'deepep' needs ep_size > 1")
    if p.moe_a2a_backend == "deepep" and not p.enable_dp_attention:
        raise LayoutError(
            "moe_a2a_backend 'deepep' needs enable_dp_attention: under TP every rank holds "
            "every token and the routed experts run without dispatch / combine"
        )
    if p.deepep_mode != "auto" and p.moe_a2a_backend != "deepep":
        raise LayoutError(
            f"deepep_mode {p.deepep_mode!r} is only used with moe_a2a_backend 'deepep', "
            f"found moe_a2a_backend {p.moe_a2a_backend!r}"
        )


def uses_eplb(p: ParallelConfig) -> bool:
    """Whether MoE layers route through logical -> physical expert ids (docs/eplb.md)."""
    return p.enable_eplb or p.ep_num_redundant_experts > 0 or p.init_expert_location is not None


def _check_eplb(p: ParallelConfig) -> None:
    if uses_eplb(p) and not (p.enable_dp_attention and p.ep_size > 1):
        raise LayoutError(
            "enable_eplb / ep_num_redundant_experts / init_expert_location need DP attention "
            f"with ep_size > 1 (experts reached by dispatch), found ep_size {p.ep_size} and "
            f"enable_dp_attention {p.enable_dp_attention}"
        )
    if p.ep_num_redundant_experts % p.ep_size:
        raise LayoutError(
            f"ep_num_redundant_experts {p.ep_num_redundant_experts} must be a multiple of "
            f"ep_size {p.ep_size} (every rank holds as many slots)"
        )
