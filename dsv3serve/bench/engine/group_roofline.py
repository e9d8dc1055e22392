"""A group rank's decode roofline: the bytes one step must read, and projections.

A decode step of a DP-attention + EP rank reads its non-expert weights, the share of its
experts the step's tokens hit, and its batch's KV, each once. At the device-to-device copy
bandwidth measured in the same run (bytes read + written per second: HBM traffic), that is
the rank's roofline; a step's ratio to it says how far the group is from its GPUs.
Projections keep a measured ratio and change the bytes: to the model's 61 layers, and to a
wider EP (fewer experts per rank). They are projections, not measurements: dispatch cost
grows with EP and is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

FULL_LAYERS, FULL_MOE_LAYERS = 61, 58  # DeepSeek-V3


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds: routed-expert bytes, embedding + LM head bytes, the rest of the
    weights, and its batch's KV bytes (all layers); ``layers`` / ``moe_layers`` counted."""

    experts: int
    head: int
    other: int
    kv: int
    layers: int
    moe_layers: int


def rank_bytes(model: DeepseekV3ForCausalLM, tokens_in_kv: int, kv_row_bytes: int) -> RankBytes:
    """``model``'s bytes by kind, with ``tokens_in_kv`` tokens of KV (``kv_row_bytes`` per
    token and layer). The NextN (MTP) layer is left out: a plain decode step never runs it."""
    sizes = {"experts": 0, "head": 0, "other": 0}
    for name, p in model.named_parameters():
        if name.startswith("nextn."):
            continue
        kind = "experts" if ".experts." in name else "other"
        if "embed_tokens" in name or name.startswith("lm_head"):
            kind = "head"
        sizes[kind] += p.numel() * p.element_size()
    cfg = model.cfg
    layers = cfg.num_hidden_layers
    moe = max(layers - cfg.first_k_dense_replace, 0)
    return RankBytes(
        **sizes, kv=tokens_in_kv * kv_row_bytes * layers, layers=layers, moe_layers=moe
    )


def hit_fraction(tokens: int, top_k: int, experts: int) -> float:
    """Expected share of experts hit when ``tokens`` tokens pick ``top_k`` each, uniformly."""
    return 1.0 - (1.0 - 1.0 / experts) ** (tokens * top_k)


def step_bytes(b: RankBytes, group_tokens: int, top_k: int, experts: int) -> float:
    """Bytes a decode step of ``group_tokens`` tokens (all ranks) makes this rank read."""
    return b.head + b.other + b.experts * hit_fraction(group_tokens, top_k, experts) + b.kv


def to_full_depth(b: RankBytes) -> RankBytes:
    """The same rank with DeepSeek-V3's 61 layers (58 MoE): per-layer bytes scaled."""
    moe = FULL_MOE_LAYERS / max(b.moe_layers, 1)
    per_layer = FULL_LAYERS / b.layers
    return RankBytes(
        experts=int(b.experts * moe),
        head=b.head,
        other=int(b.other * per_layer),
        kv=int(b.kv * FULL_LAYERS / b.layers),
        layers=FULL_LAYERS,
        moe_layers=FULL_MOE_LAYERS,
    )


def to_ep(b: RankBytes, ep_now: int, ep: int) -> RankBytes:
    """The same rank in an EP group of ``ep`` ranks: ``ep_now / ep`` of the experts each."""
    return RankBytes(int(b.experts * ep_now / ep), b.head, b.other, b.kv, b.layers, b.moe_layers)


def roofline_ms(bytes_read: float, copy_bytes_per_s: float) -> float:
    return 1e3 * bytes_read / copy_bytes_per_s
