"""Bytes one EP rank must read per decode step, given the batch's routing.

Per step the rank reads: every decoder layer's norms and absorbed-form attention weights
(``model.roofline``), the dense MLP of the first layers, each MoE layer's router and shared
expert plus its LOCAL experts that the batch's routing hits (with the same-rank loopback no
other rank's tokens arrive, so only this rank's tokens count), every sequence's cached
latents in every layer, and the final norm, the whole ``lm_head`` and the new tokens'
embedding rows. Activations are not counted. Choices of experts on other ranks reach the
fused MoE as id -1 and are skipped, so the kernel reads exactly the hit experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv3serve.bench.model.roofline import (
    attention_decode_bytes,
    expert_bytes,
    head_bytes,
    kv_read_bytes,
    mlp_decode_bytes,
    moe_fixed_bytes,
    norm_bytes,
)
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.model.deepseek_v3 import MoE


def local_hits(calls: list[torch.Tensor], experts: range) -> list[int]:
    """From each MoE layer's global ``topk_ids`` [T, K]: the distinct local experts chosen."""
    hits = []
    for ids in calls:
        here = (ids >= experts.start) & (ids < experts.stop)
        hits.append(int(ids[here].unique().numel()))
    return hits


@dataclass(frozen=True)
class StepBytes:
    """Bytes of one decode step by kind."""

    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def step_bytes(runner: ModelRunner, batch_size: int, context: int, hits: list[int]) -> StepBytes:
    """The rank's bytes for ``batch_size`` sequences at ``context``, ``hits`` local experts
    per MoE layer."""
    model = runner.model
    parts = dict.fromkeys(("attention", "dense_mlp", "moe_fixed", "routed_experts"), 0.0)
    moe = 0
    for layer in model.decoder_layers:
        parts["attention"] += norm_bytes(layer) + attention_decode_bytes(layer.self_attn)
        if not isinstance(layer.mlp, MoE):
            parts["dense_mlp"] += mlp_decode_bytes(layer.mlp, batch_size)
            continue
        one = expert_bytes(layer.mlp)
        parts["moe_fixed"] += moe_fixed_bytes(layer.mlp)
        parts["routed_experts"] += hits[moe] * one
        moe += 1
    parts["head"] = float(head_bytes(model, batch_size))
    parts["kv"] = float(kv_read_bytes(runner.pool, batch_size, context) * len(model.layers))
    if moe != len(hits):
        raise ValueError(f"expected routing for {moe} MoE layers, found {len(hits)}")
    return StepBytes(parts)
