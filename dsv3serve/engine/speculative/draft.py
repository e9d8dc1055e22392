"""The checkpoint's NextN (MTP) layer as an EAGLE-style draft model.

For a new token at position ``p`` the draft takes the token ``t[p+1]`` and a hidden state
of position ``p``, as DeepSeek's MTP module does::

    x = eh_proj([enorm(embed(t[p+1])) ; hnorm(h[p])])  ->  decoder block  ->  shared_head norm

and its head (the target's ``lm_head``) then guesses ``t[p+2]``. ``h[p]`` is the target's
final hidden state (after the final norm) where the target has computed position ``p``,
and the draft's own output at ``p`` for the chained steps beyond (SGLang's convention).

The draft's decoder block is layer ``num_hidden_layers`` of the KV pool
(``DeepseekV3ForCausalLM.num_kv_layers`` counts it), addressed by the same page table and
slots as the target: position ``p`` of a sequence has a target row and a draft row.
"""

from __future__ import annotations

import torch

from dsv3serve.attention.base import AttentionBackend
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM, MoE, NextNLayer


class NextNDraft:
    """``model.nextn`` with the target's embedding and head; no weights of its own."""

    def __init__(self, target: DeepseekV3ForCausalLM) -> None:
        if target.nextn is None:
            raise ValueError(
                "speculative_algorithm NEXTN needs a checkpoint with a NextN layer: expected "
                "num_nextn_predict_layers=1, got 0"
            )
        self.target = target
        self.layer: NextNLayer = target.nextn

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        attn: AttentionBackend,
        planned: bool = False,
    ) -> torch.Tensor:
        """Draft hidden states [T, H] (after the shared head norm) for the batch's tokens.

        ``batch.input_ids[i]`` is ``t[p+1]`` for the new position ``p = batch.positions[i]``
        and ``hidden[i]`` [H] the hidden state of ``p``. Writes the draft's KV at ``p``.
        ``planned``: ``attn`` is already planned for ``batch`` (CUDA-graph replays).
        """
        if hidden.shape[0] != batch.num_tokens:
            raise ValueError(
                f"expected one hidden state per draft token ({batch.num_tokens}), "
                f"got {hidden.shape[0]}"
            )
        ctx = self.target.step_context(batch, attn, planned)
        embeds = self.target.embed_tokens(batch.input_ids)
        out = self.layer(embeds, hidden.to(embeds.dtype), ctx)
        return self.layer.shared_head_norm(out)

    @torch.inference_mode()
    def forward_idle(self) -> None:
        """A draft step with no tokens on this rank (DP attention): joins its MoE layer's
        dispatch / combine, the only collective of the draft's decoder block there."""
        mlp = self.layer.block.mlp
        if isinstance(mlp, MoE):
            mlp(self.target.embed_tokens.weight.new_empty((0, self.target.cfg.hidden_size)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] float32 of draft hidden states [N, H], through the shared head."""
        return self.target.compute_logits(hidden)
