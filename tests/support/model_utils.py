"""Test helpers that run our model on whole sequences through the paged reference path."""

from __future__ import annotations

from pathlib import Path

import torch

from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.config import ModelConfig
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kvcache.pool import MLAKVPool
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, ModelOptions
from dsv3serve.model.weights import load_checkpoint

PAGE = 4


def load_ours(model_dir: Path, **opts: object) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(ModelConfig.from_hf(model_dir), ModelOptions(**opts))
    load_checkpoint(model, model_dir)
    return model


def make_attn(model: DeepseekV3ForCausalLM, num_pages: int = 256) -> TorchRefAttention:
    pool = MLAKVPool(
        model.num_kv_layers, num_pages, PAGE, model.cfg.kv_cache_dim, model.opts.dtype, "cpu"
    )
    return TorchRefAttention(pool, model.cfg.kv_lora_rank)


def scattered_slots(seq_index: int, length: int) -> list[int]:
    """Slots for one sequence on non-contiguous pages (page p of seq s is 7*p + s)."""
    return [(7 * (pos // PAGE) + seq_index) * PAGE + pos % PAGE for pos in range(length)]


def prefill_logits(
    model: DeepseekV3ForCausalLM, attn: TorchRefAttention, prompts: list[list[int]]
) -> list[torch.Tensor]:
    """Logits at every position of every prompt, computed in ONE batched forward."""
    spans = [SeqSpan(p, 0, scattered_slots(i, len(p))) for i, p in enumerate(prompts)]
    batch = ForwardBatch.build(spans, "cpu")
    batch.logits_indices = torch.arange(batch.num_tokens)
    logits = model.compute_logits(model(batch, attn)[batch.logits_indices])
    return list(logits.split([len(p) for p in prompts]))


def greedy_generate(
    model: DeepseekV3ForCausalLM, attn: TorchRefAttention, prompts: list[list[int]], steps: int
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Batched greedy loop: prefill all prompts, then ``steps`` decode steps.

    Returns the generated ids and, per prompt, the logits that chose each token.
    """
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    logit_log: list[list[torch.Tensor]] = [[] for _ in prompts]
    spans = [SeqSpan(p, 0, scattered_slots(i, len(p))) for i, p in enumerate(prompts)]
    for _ in range(steps):
        batch = ForwardBatch.build(spans, "cpu")
        logits = model.compute_logits(model(batch, attn)[batch.logits_indices])
        for i, row in enumerate(logits):
            token = int(row.argmax())
            outs[i].append(token)
            logit_log[i].append(row)
            seqs[i].append(token)
        spans = [
            SeqSpan([s[-1]], len(s) - 1, scattered_slots(i, len(s))) for i, s in enumerate(seqs)
        ]
    return outs, logit_log
