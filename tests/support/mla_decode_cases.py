"""MLA decode test cases over a bf16 or fp8 pool, shared by the interpreter and GPU tests.

Built on :func:`attention_cases.make_case` (its batch and page layout) with a pool of the
asked dtype: every slot a sequence uses (the new tokens' too, as a layer saves them before
attending) holds fresh random latents, every other value and fp8 scale is NaN.
"""

from __future__ import annotations

import torch
from attention_cases import Case, make_case

from dsv3serve.attention.base import MLADims
from dsv3serve.kvcache.pool import MLAKVPool


def poisoned_pool(like: MLAKVPool, dtype: torch.dtype) -> MLAKVPool:
    """A pool shaped like ``like`` of ``dtype``, NaN everywhere (scales included)."""
    pool = MLAKVPool(
        like.num_layers, like.num_pages, like.page_size, like.kv_dim, dtype, like.device
    )
    for layer in range(pool.num_layers):
        scales = pool.scale_buffer(layer)
        if scales is None:
            pool.kv_buffer(layer).fill_(float("nan"))
        else:
            pool.kv_buffer(layer).view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
            scales.fill_(float("nan"))
    return pool


def fp8_case(
    dims: MLADims,
    new_tokens: list[int],
    cached: list[int],
    page_size: int,
    dtype: torch.dtype = torch.float8_e4m3fn,
    device: str = "cpu",
    seed: int = 0,
    **kw,
) -> Case:
    """A :class:`Case` whose pool has ``dtype``; all of the batch's slots written."""
    case = make_case(dims, new_tokens, cached, device, page_size, seed=seed, **kw)
    pool = poisoned_pool(case.pool, dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 100)
    n = case.batch.kv_slots.numel()
    for layer in range(pool.num_layers):
        latent = torch.randn(n, dims.kv_cache_dim, generator=gen, device=device)
        pool.write(layer, case.batch.kv_slots, latent)
    return Case(pool, case.batch, case.new_latents)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error (norm); fails on a non-finite output."""
    assert bool(torch.isfinite(got).all()), "non-finite output"
    return float((got.float() - want.float()).norm() / want.float().norm())
