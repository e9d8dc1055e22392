"""Attention-backend test cases shared by the CPU (fake flashinfer) and GPU tests.

A case is a batch of sequences over a NaN-poisoned paged pool: every slot a sequence
uses holds fresh random latents, every other slot NaN, so a stray read shows. Both the
backend under test and :class:`TorchRefAttention` read the same pool.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from dsv3serve.attention.base import AttentionBackend, MLADims
from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kvcache.pool import MLAKVPool

YARN_MSCALE = 0.1 * math.log(40) + 1  # DeepSeek-V3's rope factor 40, mscale_all_dim 1
DEEPSEEK_ATTENTION = {  # tiny-checkpoint overrides: DeepSeek-V3's attention shapes
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
DEEPSEEK_DIMS = MLADims(128, 512, 128, 64, 128, 192**-0.5 * YARN_MSCALE**2)
SMALL_DIMS = MLADims(64, 32, 16, 16, 16, 32**-0.5)

# bf16 keeps 8 significant bits (a relative step of 2^-8 = 3.9e-3). Both sides round
# their output to bf16 once; flashinfer also rounds the probabilities to bf16 before the
# PV product, and an extend rounds again at each merge. Four steps bound the error.
BF16_TOL = 4 * 2**-8


@dataclass
class Case:
    pool: MLAKVPool
    batch: ForwardBatch
    new_latents: torch.Tensor  # [T, 576]: what each layer saves for the new tokens


def make_pool(
    dims: MLADims, num_pages: int, page_size: int, device: str, layers: int = 2, **pool_kw
) -> MLAKVPool:
    """A NaN-poisoned pool (bf16 unless ``pool_kw`` says ``dtype``, ``fp8_scales``, ...)."""
    pool_kw.setdefault("dtype", torch.bfloat16)
    pool = MLAKVPool(layers, num_pages, page_size, dims.kv_cache_dim, device=device, **pool_kw)
    for layer in range(layers):
        pool.kv_buffer(layer).fill_(float("nan"))
    return pool


def _page_slots(pages: list[int], page_size: int, length: int) -> list[int]:
    return [pages[p // page_size] * page_size + p % page_size for p in range(length)]


def make_case(
    dims: MLADims,
    new_tokens: list[int],
    cached: list[int],
    device: str,
    page_size: int = 64,
    decode: bool | None = None,
    aligned: bool = True,
    seed: int = 0,
    **pool_kw,
) -> Case:
    """Sequence ``b`` has ``cached[b]`` tokens in the cache and ``new_tokens[b]`` new ones.

    ``aligned``: pages from a shuffled free list (what the engine does); otherwise every
    token gets a random slot (no page structure). ``pool_kw``: see :func:`make_pool`.
    """
    rng = random.Random(seed)
    totals = [c + n for c, n in zip(cached, new_tokens, strict=True)]
    need = [-(-t // page_size) for t in totals]
    pool = make_pool(dims, sum(need) + 3, page_size, device, **pool_kw)
    free = list(range(pool.num_pages))
    rng.shuffle(free)
    slots_free = list(range(pool.num_slots))
    rng.shuffle(slots_free)
    spans = []
    for b, total in enumerate(totals):
        if aligned:
            pages, free = free[: need[b]], free[need[b] :]
            slots = _page_slots(pages, page_size, total)
        else:
            slots, slots_free = slots_free[:total], slots_free[total:]
        spans.append(SeqSpan([1] * new_tokens[b], cached[b], slots))
    batch = ForwardBatch.build(spans, device, decode=decode)
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in range(pool.num_layers):
        prefix = torch.cat(
            [
                batch.kv_slots[batch.kv_indptr[b] : batch.kv_indptr[b] + cached[b]]
                for b in range(len(spans))
            ]
        )
        pool.write(layer, prefix, _randn(len(prefix), dims.kv_cache_dim, gen, device))
    new = _randn(batch.num_tokens, dims.kv_cache_dim, gen, device)
    return Case(pool, batch, new)


def _randn(rows: int, cols: int, gen: torch.Generator, device: str) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen, device=device).to(torch.bfloat16)


def random_expand_kv(dims: MLADims, device: str, seed: int = 1):
    """A random ``kv_b_proj`` as the model applies it: latents [S, 576] -> K [S, H, 192]
    (contiguous) and V [S, H, 128] (a strided view, as the model returns it)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
    w = torch.randn(dims.kv_lora_rank, out, generator=gen, device=device) * dims.kv_lora_rank**-0.5
    w = w.to(torch.bfloat16)

    def expand(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, h = latent.shape[0], dims.num_heads
        kv = (latent[:, : dims.kv_lora_rank] @ w).view(s, h, -1)
        k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
        k_pe = latent[:, None, dims.kv_lora_rank :].expand(s, h, dims.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    return expand


def run_layers(
    backend: AttentionBackend, case: Case, dims: MLADims, absorbed: bool, seed: int = 2
) -> list[torch.Tensor]:
    """Plan once, then per layer save the new latents and attend with fresh random q."""
    backend.plan(case.batch)
    device = str(case.batch.kv_slots.device)
    gen = torch.Generator(device=device).manual_seed(seed)
    t, h = case.batch.num_tokens, dims.num_heads
    expand, outs = random_expand_kv(dims, device), []
    for layer in range(case.pool.num_layers):
        backend.save_latent(layer, case.new_latents)
        if absorbed:
            q = torch.randn(t, h, dims.kv_cache_dim, generator=gen, device=device)
            q_latent, q_pe = q.to(torch.bfloat16).split(
                [dims.kv_lora_rank, dims.qk_rope_head_dim], -1
            )
            outs.append(backend.forward_absorbed(q_latent, q_pe, layer, dims.softmax_scale))
        else:
            q = torch.randn(t, h, dims.qk_head_dim, generator=gen, device=device)
            outs.append(
                backend.forward_mha(q.to(torch.bfloat16), layer, dims.softmax_scale, expand)
            )
    return outs


def compare_with_ref(backend: AttentionBackend, case: Case, dims: MLADims, absorbed: bool) -> None:
    """The backend's outputs match TorchRefAttention's on every layer."""
    got = run_layers(backend, case, dims, absorbed)
    want = run_layers(TorchRefAttention(case.pool, dims.kv_lora_rank), case, dims, absorbed)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        assert torch.isfinite(g).all(), f"layer {layer}: non-finite output"
        scale = w.float().abs().max().item()
        torch.testing.assert_close(
            g.float(), w.float(), rtol=BF16_TOL, atol=BF16_TOL * scale, msg=f"layer {layer}"
        )
        mean_err = (g.float() - w.float()).abs().mean() / w.float().abs().mean()
        assert mean_err < BF16_TOL / 4, f"layer {layer}: mean relative error {mean_err:.2e}"
