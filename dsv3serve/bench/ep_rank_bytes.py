"""Bytes one EP rank must read per decode step, given the batch's routing.

Per step the rank reads: every decoder layer's norms and absorbed-form attention weights
(``model_roofline``), the dense MLP of the first layers, each MoE layer's router and shared
expert plus its LOCAL experts that the batch's routing hits (with the same-rank loopback no
other rank's tokens arrive, so only this rank's tokens count), every sequence's cached
latents in every layer, and the final norm, the whole ``lm_head`` and the new tokens'
embedding rows. Activations are not counted.

The fused MoE kernel also reads local expert 0 whenever a dispatched row has a slot on
another rank (the caller clamps those ids to 0 with weight 0); that read is not needed by
the routing and is reported apart (``kernel_extra_bytes``), not in the roofline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv3serve.bench.model_roofline import (
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


@dataclass(frozen=True)
class LocalHits:
    """Per MoE layer: local experts the routing hits, and those the kernel reads."""

    hit: list[int]
    read: list[int]


def local_hits(calls: list[torch.Tensor], experts: range) -> LocalHits:
    """From each MoE layer's global ``topk_ids`` [T, K]: distinct local experts chosen, and
    those plus expert ``experts.start`` where any slot lies elsewhere (clamped to slot 0)."""
    hit, read = [], []
    for ids in calls:
        here = (ids >= experts.start) & (ids < experts.stop)
        chosen = set(ids[here].unique().tolist())
        hit.append(len(chosen))
        read.append(len(chosen | {experts.start}) if bool((~here).any()) else len(chosen))
    return LocalHits(hit, read)


@dataclass(frozen=True)
class StepBytes:
    """Bytes of one decode step by kind; ``kernel_extra`` is outside the roofline."""

    parts: dict[str, float]
    kernel_extra: float

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def step_bytes(runner: ModelRunner, batch_size: int, context: int, hits: LocalHits) -> StepBytes:
    """The rank's bytes for ``batch_size`` sequences at ``context`` with routing ``hits``."""
    model = runner.model
    parts = dict.fromkeys(("attention", "dense_mlp", "moe_fixed", "routed_experts"), 0.0)
    extra, moe = 0.0, 0
    for layer in model.layers:
        parts["attention"] += norm_bytes(layer) + attention_decode_bytes(layer.self_attn)
        if not isinstance(layer.mlp, MoE):
            parts["dense_mlp"] += mlp_decode_bytes(layer.mlp, batch_size)
            continue
        one = expert_bytes(layer.mlp)
        parts["moe_fixed"] += moe_fixed_bytes(layer.mlp)
        parts["routed_experts"] += hits.hit[moe] * one
        extra += (hits.read[moe] - hits.hit[moe]) * one
        moe += 1
    parts["head"] = float(head_bytes(model, batch_size))
    parts["kv"] = float(kv_read_bytes(runner.pool, batch_size, context) * len(model.layers))
    if moe != len(hits.hit):
        raise ValueError(f"expected routing for {moe} MoE layers, found {len(hits.hit)}")
    return StepBytes(parts, extra)
