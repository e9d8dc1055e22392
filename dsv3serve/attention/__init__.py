"""MLA attention backends behind one interface; choose with :func:`create_attention_backend`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsv3serve.attention.base import AttentionBackend

if TYPE_CHECKING:
    from dsv3serve.kvcache.pool import MLAKVPool

ATTENTION_BACKENDS = ("torch",)


def create_attention_backend(name: str, pool: MLAKVPool, kv_lora_rank: int) -> AttentionBackend:
    """Build the named backend; raises ValueError naming the supported ones."""
    if name == "torch":
        from dsv3serve.attention.ref import TorchRefAttention

        return TorchRefAttention(pool, kv_lora_rank)
    raise ValueError(f"attention backend {name!r} unknown; supported: {list(ATTENTION_BACKENDS)}")
