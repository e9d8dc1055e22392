"""``enable_torch_compile``: the decode forward that CUDA graphs capture, through torch.compile.

As in SGLang, compilation applies to the captured decode batch sizes up to
``torch_compile_max_bs``; larger captured sizes, prefill and extend steps stay eager. The
compiled kernels are then recorded into the CUDA graphs, so a replay pays no Python or
guard cost. Off by default, and only on the CUDA-graph path (CUDA and an attention
backend that supports CUDA graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from dsv3serve.attention.base import AttentionBackend
from dsv3serve.engine.config import EngineConfig
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)

COMPILE_MODE = "max-autotune-no-cudagraphs"  # the graphs are ours, captured afterwards


class CompiledDecodeModel:
    """``model`` as :class:`DecodeGraphs` calls it, its forward compiled for small batches.

    ``__call__(batch, attn, planned)`` returns the normed hidden states [T, H] like the
    model's forward; batches of more than ``max_bs`` sequences run the eager forward.
    """

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        max_bs: int,
        compiler: Callable[..., Any] | None = None,
        **compile_kwargs: Any,
    ) -> None:
        """``compiler`` (default ``torch.compile``) gets the forward and ``compile_kwargs``
        over the defaults ``mode=COMPILE_MODE, dynamic=False``."""
        self.model, self.max_bs = model, max_bs
        kwargs: dict[str, Any] = {"mode": COMPILE_MODE, "dynamic": False} | compile_kwargs
        self._compiled = (compiler or torch.compile)(model.forward, **kwargs)

    def __call__(
        self, batch: ForwardBatch, attn: AttentionBackend, planned: bool = False
    ) -> torch.Tensor:
        eager = batch.batch_size > self.max_bs
        forward = self.model.forward if eager else self._compiled
        return forward(batch, attn, planned=planned)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] float32 (the LM head stays eager)."""
        return self.model.compute_logits(hidden)


def decode_model(
    model: DeepseekV3ForCausalLM, cfg: EngineConfig, sizes: list[int]
) -> DeepseekV3ForCausalLM | CompiledDecodeModel:
    """What the decode CUDA graphs capture: ``model``, or its compiled wrapper when
    ``cfg.enable_torch_compile`` (call only on the CUDA-graph path)."""
    if not cfg.enable_torch_compile:
        return model
    compiled_sizes = [s for s in sizes if s <= cfg.torch_compile_max_bs]
    # dynamic=False compiles once per batch size: leave room for every captured one
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = max(limit, len(compiled_sizes) + 8)
    logger.info("torch.compile (%s) of the decode forward, sizes %s", COMPILE_MODE, compiled_sizes)
    return CompiledDecodeModel(model, cfg.torch_compile_max_bs)


def warn_if_compile_unused(cfg: EngineConfig, use_graphs: bool) -> None:
    """``enable_torch_compile`` acts on the captured decode graphs only; say when there are none."""
    if cfg.enable_torch_compile and not use_graphs:
        logger.warning(
            "enable_torch_compile: ignored, it compiles the CUDA-graph decode forward, which "
            "needs device cuda, an attention backend with CUDA graphs (flashinfer) and CUDA "
            "graphs on (found device %s, attention_backend %s, disable_cuda_graph %s)",
            cfg.device,
            cfg.attention_backend,
            cfg.disable_cuda_graph,
        )
