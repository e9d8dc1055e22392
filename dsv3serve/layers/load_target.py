"""Where one checkpoint tensor lands inside the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LoadTarget:
    """A parameter (or an index into it) that one checkpoint tensor fills."""

    param: torch.Tensor
    index: tuple[Any, ...] | None = None

    def view(self) -> torch.Tensor:
        return self.param.data if self.index is None else self.param.data[self.index]
