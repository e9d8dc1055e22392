"""Bytes a decode step must read, per layer, and the roofline time at a copy bandwidth.

A decode step over ``T`` new tokens reads, per decoder layer: the attention weights the
absorbed (MQA) form uses (every MLA projection except ``kv_b_proj``, plus the derived
``W_UK`` / ``W_UV``), the norms, the MLP's weights (MoE: router, shared expert and the
expected number of distinct routed experts hit under uniform routing,
``E * (1 - (1 - k/E)^T)``), and each sequence's cached latents. Outside the layers it
reads the final norm, the LM head and one embedding row per token. Activations are small
at decode sizes and not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from dsv3serve.kvcache.pool import MLAKVPool, bytes_per_page
from dsv3serve.model.deepseek_v3 import DecoderLayer, DeepseekV3ForCausalLM, MLAttention, MoE


def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts chosen by ``tokens`` tokens picking ``top_k`` of
    ``num_experts`` uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (packed views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _params(module: nn.Module, skip: tuple[str, ...] = ()) -> list[torch.Tensor]:
    return [p for name, p in module.named_parameters() if not name.startswith(skip)]


def attention_decode_bytes(attn: MLAttention) -> int:
    """Weights the absorbed form reads: all but ``kv_b_proj``, plus ``W_UK`` and ``W_UV``."""
    derived = [t for t in (attn.w_uk, attn.w_uv) if t is not None]
    return storage_bytes(_params(attn, skip=("kv_b_proj.",)) + derived)


def expert_bytes(mlp: MoE) -> float:
    """Bytes of one routed expert of the layer's stack (weights and FP8 scales)."""
    experts = mlp.experts
    slots = experts.num_experts + experts.shared_slots  # a fused shared expert is slot E
    return storage_bytes(_params(experts)) / slots


def moe_fixed_bytes(mlp: MoE) -> int:
    """Router and shared expert: what an MoE layer reads whatever the routing."""
    # element bytes: a fused shared expert's weights are views into the expert stack
    return sum(p.numel() * p.element_size() for p in _params(mlp, skip=("experts.",)))


def mlp_decode_bytes(mlp: nn.Module, tokens: int) -> float:
    """Dense MLP: all weights; MoE: router + shared expert + expected distinct experts."""
    if not isinstance(mlp, MoE):
        return float(storage_bytes(_params(mlp)))
    hit = expected_experts_hit(mlp.experts.num_experts, mlp.cfg.num_experts_per_tok, tokens)
    return moe_fixed_bytes(mlp) + hit * expert_bytes(mlp)


def norm_bytes(layer: DecoderLayer) -> int:
    """The layer's two RMSNorm weights."""
    return storage_bytes(_params(layer.input_layernorm) + _params(layer.post_attention_layernorm))


def layer_weight_bytes(layer: DecoderLayer, tokens: int) -> float:
    """Weight bytes one decoder layer reads for a decode step of ``tokens`` new tokens."""
    return (
        norm_bytes(layer)
        + attention_decode_bytes(layer.self_attn)
        + mlp_decode_bytes(layer.mlp, tokens)
    )


def kv_read_bytes(pool: MLAKVPool, batch_size: int, context: int) -> int:
    """Cached latents one layer reads: ``context + 1`` rows per sequence (with fp8 scales)."""
    return batch_size * (context + 1) * bytes_per_page(1, 1, pool.dtype, pool.kv_dim)


def head_bytes(model: DeepseekV3ForCausalLM, tokens: int) -> int:
    """Final norm, LM head and the embedding rows of the new tokens."""
    row = model.cfg.hidden_size * model.embed_tokens.weight.element_size()
    return storage_bytes(_params(model.norm) + _params(model.lm_head)) + tokens * row


@dataclass(frozen=True)
class Roofline:
    """Bytes per part of a decode step (``layer{i}`` and ``head``) and the copy bandwidth."""

    bytes: dict[str, float]
    copy_TBps: float

    def bytes_ms(self, nbytes: float) -> float:
        """Milliseconds to read ``nbytes`` at the copy bandwidth."""
        return nbytes / (self.copy_TBps * 1e9)

    def ms(self, part: str) -> float:
        """Time to read ``part``'s bytes at the copy bandwidth."""
        return self.bytes_ms(self.bytes[part])

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())


def decode_roofline(
    model: DeepseekV3ForCausalLM, pool: MLAKVPool, batch_size: int, context: int, copy_TBps: float
) -> Roofline:
    """The roofline of one decode step of ``batch_size`` sequences at ``context``."""
    kv = kv_read_bytes(pool, batch_size, context)
    parts = {
        f"layer{i}": layer_weight_bytes(layer, batch_size) + kv
        for i, layer in enumerate(model.decoder_layers)
    }
    parts["head"] = float(head_bytes(model, batch_size))
    return Roofline(parts, copy_TBps)
