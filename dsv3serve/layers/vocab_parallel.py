"""Full logits from a vocab-parallel ``lm_head`` (each rank holds ``ceil(V / parts)`` rows).

Three modes, chosen once from the layout (:func:`logits_mode`):

* ``local``: the head is whole on this rank; no collective.
* ``vocab``: every rank has the same hidden rows (TP); one all_gather of the vocab slices.
* ``rows_vocab``: each rank has its own rows (DP attention); collectives in this order:
  ``all_gather_rows`` of the hidden rows (syncs the host for the counts, except in a uniform
  batch), the local vocab slice for every rank's rows, one all-to-all that sends each rank
  the slices of its own rows: a rank receives its rows' logits, not every rank's (an
  all-gather along the vocabulary moved ``world`` times as much). Every rank must call it
  each step, also with zero rows.
"""

from __future__ import annotations

from typing import Literal

import torch

from dsv3serve.layers.linear import Linear
from dsv3serve.parallel.comm import Comm
from dsv3serve.parallel.shard import RankLayout

LogitsMode = Literal["local", "vocab", "rows_vocab"]


def logits_mode(layout: RankLayout | None) -> LogitsMode:
    """How this layout's ``lm_head`` turns hidden rows into full logits."""
    if layout is None or layout.parallel.lm_head_tp_size == 1:
        return "local"
    return "rows_vocab" if layout.parallel.enable_dp_attention else "vocab"


def vocab_parallel_logits(
    head: Linear, hidden: torch.Tensor, comm: Comm, mode: LogitsMode, vocab_size: int
) -> torch.Tensor:
    """Logits [N, V] float32 for this rank's hidden rows [N, H] (``head`` holds
    ``ceil(V / parts)`` rows, zero past ``V`` on the last ranks; those columns are cut)."""
    if mode == "local":
        return head(hidden).float()
    if mode == "vocab":
        return comm.all_gather(head(hidden), dim=-1)[:, :vocab_size].float()
    rows, counts = comm.all_gather_rows(hidden)
    most = max(counts)
    slices = comm.all_to_all_rows(head(rows))  # block r: rank r's vocab slice of my rows
    logits = slices.view(comm.world_size, most, slices.shape[-1]).transpose(0, 1)
    logits = logits.reshape(most, comm.world_size * slices.shape[-1])
    return logits[: counts[comm.rank], :vocab_size].float()
