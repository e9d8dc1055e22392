"""The steps the model bench times, each a callable that marks its parts (see timing)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv3serve.attention.base import AttentionBackend
from dsv3serve.bench.model.timing import Marks
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

Step = Callable[[Marks], None]


def forward_step(
    model: DeepseekV3ForCausalLM,
    attn: AttentionBackend,
    batch: ForwardBatch,
    logits_rows: torch.Tensor,
) -> Step:
    """The target model over ``batch`` and its float32 logits at ``logits_rows`` (no sampling).

    Parts: ``embed`` (step planning, rotary, embedding), ``layer{i}`` (with
    :func:`~dsv3serve.bench.model.timing.layer_marks` active) and ``head`` (final norm, LM head).
    """

    def run(marks: Marks) -> None:
        marks.mark("embed")
        hidden = model(batch, attn)
        model.compute_logits(hidden[logits_rows])
        marks.mark("end")

    return run


def draft_step(
    draft: NextNDraft, attn: AttentionBackend, batch: ForwardBatch, hidden: torch.Tensor
) -> Step:
    """One chained MTP draft step: the NextN layer over ``batch`` (one token per sequence,
    ``hidden`` [B, H] the previous hidden states) and its logits through the shared head."""

    def run(marks: Marks) -> None:
        marks.mark("draft")
        draft.compute_logits(draft.forward(batch, hidden, attn))
        marks.mark("end")

    return run
