"""Test helpers for speculative decoding: a target oracle draft, from-scratch drafts, and
a checkpoint whose NextN layer is an oracle.

The first two run the engine's own weights in a scratch KV pool (never the engine's pool),
one fresh prefill per call: slow, simple, and independent of the engine's KV bookkeeping.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.scheduler.sequence import ScheduledItem
from dsv3serve.engine.speculative.draft import NextNDraft
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kvcache.pool import MLAKVPool
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsv3serve.model.tiny import TINY_CONFIG, make_tiny_checkpoint


class ScratchModel:
    """The engine's model over a private KV pool; sequence ``i`` owns slots ``i*R ..``."""

    def __init__(self, model: DeepseekV3ForCausalLM, num_seqs: int, region: int) -> None:
        self.model, self.region = model, region
        cfg, dtype = model.cfg, model.opts.dtype
        pool = MLAKVPool(model.num_kv_layers, num_seqs * region, 1, cfg.kv_cache_dim, dtype)
        self.attn = TorchRefAttention(pool, cfg.kv_lora_rank)

    def span(self, i: int, tokens: list[int], start: int, sample: bool = True) -> SeqSpan:
        end = start + len(tokens)
        return SeqSpan(tokens, start, list(range(i * self.region, i * self.region + end)), sample)

    @torch.inference_mode()
    def target(self, spans: list[SeqSpan]) -> tuple[ForwardBatch, torch.Tensor]:
        """Target hidden states [T, H] of the spans' tokens."""
        batch = ForwardBatch.build(spans, "cpu")
        return batch, self.model(batch, self.attn)

    def greedy(self, contexts: list[list[int]], steps: int) -> list[list[int]]:
        """``steps`` greedy target tokens after each context (batched)."""
        contexts = [list(c) for c in contexts]
        spans = [self.span(i, c, 0) for i, c in enumerate(contexts)]
        for _ in range(steps):
            batch, hidden = self.target(spans)
            tokens = self.model.compute_logits(hidden[batch.logits_indices]).argmax(-1)
            for c, token in zip(contexts, tokens.tolist(), strict=True):
                c.append(token)
            spans = [self.span(i, c[-1:], len(c) - 1) for i, c in enumerate(contexts)]
        return [c[len(c) - steps :] for c in contexts]


class TargetOracleDraft:
    """TEST ORACLE, not a draft model: proposes what the target itself would generate.

    Replaces ``SpecDecoder.propose``: each decode item's drafts are the target's greedy
    continuation of its tokens so far, computed by running the target on them from
    scratch. With ``wrong > 0`` each draft token is replaced by a wrong one with that
    probability (seeded), so rounds accept some drafts and reject the rest.
    """

    def __init__(self, engine: Engine, wrong: float = 0.0, seed: int = 0) -> None:
        self.model = engine.runner.model
        self.wrong, self.rng = wrong, random.Random(seed)

    def propose(self, items: list[ScheduledItem]) -> dict[str, list[int]]:
        rows = [item for item in items if item.num_lookahead]
        if not rows:
            return {}
        contexts = [item.seq.all_token_ids for item in rows]
        steps = max(item.num_lookahead for item in rows)
        scratch = ScratchModel(self.model, len(rows), max(map(len, contexts)) + steps)
        greedy = scratch.greedy(contexts, steps)
        pairs = zip(rows, greedy, strict=True)
        return {item.seq_id: self._spoil(g[: item.num_lookahead]) for item, g in pairs}

    def _spoil(self, drafts: list[int]) -> list[int]:
        vocab = self.model.cfg.vocab_size
        return [(t + 1) % vocab if self.rng.random() < self.wrong else t for t in drafts]


def scratch_drafts(model: DeepseekV3ForCausalLM, context: list[int], steps: int) -> list[int]:
    """The NextN chain after ``context`` recomputed from nothing, in one pass per step.

    Target over ``context[:-1]``; draft over every position ``p`` with the target's
    ``h[p]`` and ``context[p+1]`` (its first draft at the last one); then chained steps.
    """
    scratch = ScratchModel(model, 1, len(context) + steps)
    draft = NextNDraft(model)
    _, hidden = scratch.target([scratch.span(0, context[:-1], 0)])
    drafts: list[int] = []
    span = scratch.span(0, context[1:], 0)
    for _ in range(steps):
        with torch.inference_mode():
            batch = ForwardBatch.build([span], "cpu")
            hidden = draft.forward(batch, hidden, scratch.attn)[batch.logits_indices]
        drafts.append(int(draft.compute_logits(hidden).argmax()))
        span = scratch.span(0, drafts[-1:], len(context) - 2 + len(drafts))
    return drafts


def make_oracle_draft_checkpoint(out_dir: Path, fp8: bool = True) -> Path:
    """TEST CHECKPOINT, not a model: a tiny checkpoint (FP8, or bf16 where ``fp8`` is
    False) whose NextN draft is always right.

    Every ``o_proj`` and ``down_proj`` is zero, so each block adds nothing to the residual:
    the target's next token is a fixed function ``f`` of the current one,
    ``argmax lm_head(norm(embed(t)))``. The NextN layer keeps only ``enorm(embed(t[p+1]))``
    (``eh_proj = [I 0]``, ``enorm`` = 1) and shares the final norm's weight, so it guesses
    ``f(t[p+1])``: the target's own next token. Speculation then accepts every draft
    (up to float ties), and each step commits ``num_steps + 1`` tokens.
    """
    path = make_tiny_checkpoint(out_dir, fp8=fp8, num_shards=1)
    tensors = load_file(str(path / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(t)
    h, mtp = TINY_CONFIG["hidden_size"], f"model.layers.{TINY_CONFIG['num_hidden_layers']}"
    eh = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors[f"{mtp}.eh_proj.weight"] = eh.to(tensors[f"{mtp}.eh_proj.weight"].dtype)
    tensors[f"{mtp}.enorm.weight"] = torch.ones_like(tensors[f"{mtp}.enorm.weight"])
    tensors[f"{mtp}.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
