"""This rank's KV pool size from the engine config, by the rules of
:mod:`dsv3serve.kvcache.sizing`: ``num_kv_tokens``, else the GPU budget or the CPU rule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.group.rank_parts import ranks_on_this_host
from dsv3serve.kvcache.sizing import (
    KVSize,
    cpu_kv_size,
    cuda_kv_budget_bytes,
    cuda_kv_size,
    explicit_kv_size,
)


def context_len(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """The longest context a request may have: ``max_model_len``, else the model's."""
    return cfg.max_model_len or model_cfg.max_position_embeddings


def rank_kv_size(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    device: torch.device,
    page_bytes: int,
    scratch_pages: int,
    reserved: Callable[[], int],
) -> KVSize:
    """This rank's pool before its group agrees on one size.

    ``scratch_pages`` (padding rows of graphed batches) come on top of an explicit or CPU
    size and out of a GPU budget; ``reserved()``: the bytes the GPU budget leaves for the
    graphs and the largest step. On CPU in a group this is a collective (every rank calls
    it): the ranks on one host share ``cpu_kv_cache_space_gib``.
    """
    page = cfg.page_size
    if cfg.num_kv_tokens is not None:
        return _plus_scratch(explicit_kv_size(cfg.num_kv_tokens, page, page_bytes), scratch_pages)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_kv_budget_bytes(free, total, cfg.mem_fraction_static, reserved())
        return cuda_kv_size(budget, cfg.mem_fraction_static, page, page_bytes)
    size = cpu_kv_size(
        max_running_requests=cfg.max_running_requests,
        context_len=context_len(cfg, model_cfg),
        space_gib=cfg.cpu_kv_cache_space_gib,
        ranks_on_host=ranks_on_this_host(),
        page_size=page,
        page_bytes=page_bytes,
    )
    return _plus_scratch(size, scratch_pages)


def _plus_scratch(size: KVSize, scratch_pages: int) -> KVSize:
    if not scratch_pages:
        return size
    reason = f"{size.reason}; + {scratch_pages} scratch pages"
    return replace(size, pages=size.pages + scratch_pages, reason=reason)


def agreed_size(size: KVSize, pages: int) -> KVSize:
    """``size`` after the group agreed on ``pages`` (the smallest rank's)."""
    if pages == size.pages:
        return size
    return replace(size, pages=pages, reason=f"{size.reason}; the group's smallest pool")
