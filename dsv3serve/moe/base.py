"""MoE backend interface: routed-expert compute given the router's choice."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from dsv3serve.moe.experts import FusedExperts
from dsv3serve.moe.gate import grouped_topk


class MoEBackend(ABC):
    """Computes ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` for every token.

    Capabilities (class attributes, so callers can ask before building one):
    ``route`` is the router the layer uses with this backend (the biased grouped top-k,
    ``grouped_topk``'s signature); ``routes_in_kernel``: that router is a fused kernel;
    ``packs_shared_expert``: ``shared_experts_fusion='auto'`` gives the expert stack the
    shared expert's slot E (see :mod:`dsv3serve.moe.shared`).
    """

    route = staticmethod(grouped_topk)
    routes_in_kernel: ClassVar[bool] = False
    packs_shared_expert: ClassVar[bool] = False

    def __init__(self, act_quant: bool = True) -> None:
        """``act_quant``: quantise activations to FP8 where the weights are FP8."""
        self.act_quant = act_quant

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        experts: FusedExperts,
        with_shared: bool = False,
    ) -> torch.Tensor:
        """x [T, H]; topk_weights [T, k] float32 (already scaled); topk_ids [T, k] int64, where
        -1 (with weight 0) marks a choice this rank does not compute (an expert on another EP
        rank): it costs nothing and adds nothing.

        ``with_shared``: the ids include the shared expert's slot E (see
        :mod:`dsv3serve.moe.shared`), so the stack's first E + 1 experts run. Returns [T, H]
        in x.dtype.
        """
