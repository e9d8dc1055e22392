"""What a rank's MoE layers share for EPLB: the id map, the load counts, the layer rows."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dsv3serve.eplb.expert_map import ExpertMap
from dsv3serve.eplb.stats import ExpertLoad

_LAYER = re.compile(r"model\.layers\.(\d+)\.mlp$")


def moe_layer_count(num_hidden_layers: int, first_k_dense: int, num_nextn: int) -> int:
    """Rows of the map and counts: the MoE decoder layers, then the NextN layers."""
    return num_hidden_layers - first_k_dense + num_nextn


@dataclass
class EplbState:
    """One rank's EPLB state. Row ``i`` is model layer ``first_k_dense + i`` (the NextN
    layer, stored as layer ``num_hidden_layers``, follows the decoder layers)."""

    expert_map: ExpertMap
    load: ExpertLoad | None
    first_k_dense: int

    @property
    def slots_per_rank(self) -> int:
        return self.expert_map.slots_per_rank

    @property
    def num_physical(self) -> int:
        return self.expert_map.placement.num_physical

    def row_of(self, prefix: str) -> int:
        """The row of MoE layer ``prefix`` (``model.layers.{i}.mlp``)."""
        m = _LAYER.fullmatch(prefix)
        if m is None or int(m.group(1)) < self.first_k_dense:
            raise ValueError(f"expected a MoE layer prefix model.layers.<i>.mlp, got {prefix}")
        return int(m.group(1)) - self.first_k_dense

    def route(self, row: int, ids: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """Count the logical choices ``ids`` [T, K] of row ``row`` (only the first ``real``
        rows, a 0-dim device tensor, when the batch is padded), return physical ids."""
        if self.load is not None:
            self.load.record(row, ids, real)
        return self.expert_map.to_physical(row, ids)
