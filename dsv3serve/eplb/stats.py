"""Per-layer, per-logical-expert routed-token counts, kept on the device.

:meth:`ExpertLoad.record` adds one batch's top-k choices with a scatter-add (no host sync,
CUDA-graph safe: ids ``-1`` and a padded batch's padding rows go to a spare bin that is
never read). :meth:`ExpertLoad.read` copies the counts to the host on demand;
:func:`hot_ratio` is the metric (max / mean per layer); :func:`dump` / :func:`load_dump`
write and read the file ``--init-expert-location`` takes at the next start.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class ExpertLoad:
    """Counts [L, E] int64 on ``device``; one row per MoE layer."""

    def __init__(self, layers: int, num_logical: int, device: torch.device) -> None:
        self.num_logical = num_logical
        self._counts = torch.zeros(layers, num_logical + 1, dtype=torch.int64, device=device)

    def record(self, layer: int, ids: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Add logical top-k ids [T, K] of MoE layer ``layer`` (``-1``: not counted). With
        ``real`` (a 0-dim integer tensor on the device, as a CUDA graph's padded batch
        carries it) only the first ``real`` rows are counted: the rest are padding."""
        counted = ids >= 0
        if real is not None:
            rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
            counted = counted & (rows < real)
        bins = torch.where(counted, ids, self.num_logical).reshape(-1)
        self._counts[layer].scatter_add_(0, bins, torch.ones_like(bins))

    def read(self) -> torch.Tensor:
        """[L, E] int64 host copy of the counts so far (syncs; call between steps)."""
        return self._counts[:, : self.num_logical].cpu()

    def reset(self) -> None:
        """Zero the counts (in place: captured graphs keep their buffer)."""
        self._counts.zero_()


def hot_ratio(counts: torch.Tensor) -> list[float]:
    """Per layer: busiest logical expert's tokens over the mean (1.0 for an empty layer)."""
    c = counts.double()
    mean = c.mean(-1)
    return [float(m / a) if a > 0 else 1.0 for m, a in zip(c.max(-1).values, mean, strict=True)]


def dump(path: Path, counts: torch.Tensor) -> None:
    """Write ``counts`` [L, E] as JSON ``{"logical_counts": [[...], ...]}``."""
    path.write_text(json.dumps({"logical_counts": counts.tolist()}))


def load_dump(path: Path, layers: int, num_logical: int) -> torch.Tensor:
    """Read a :func:`dump` file; its shape must be [layers, num_logical]."""
    try:
        data = json.loads(path.read_text())
        counts = torch.tensor(data["logical_counts"], dtype=torch.float64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"expected an expert-load dump at {path}: {exc}") from exc
    if list(counts.shape) != [layers, num_logical] or bool((counts < 0).any()):
        raise ValueError(
            f"expected non-negative counts of shape [{layers}, {num_logical}] in {path}, "
            f"got {list(counts.shape)}"
        )
    return counts
