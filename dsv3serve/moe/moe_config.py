"""Launch configurations of the fused Triton MoE: tuned JSON tables, else a default rule.

A table is one JSON file per (experts E, intermediate size N, hidden size K, device, weight
dtype), written by ``python -m dsv3serve.moe.tune``, named like
``E=256,N=2048,K=7168,device=NVIDIA_H100_80GB_HBM3,dtype=fp8.json`` and kept in
``dsv3serve/moe/configs/``. It maps a token count T (the batch's rows) to a
:class:`MoEConfig`; a batch uses the entry of the smallest T at or above its own (the largest
entry past the end). Without a table, :func:`default_config` picks by the expected rows per
expert.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).parent / "configs"
SCALE_BLOCK = 128  # DeepSeek's FP8 block: weights 128x128, activations 1x128


@dataclass(frozen=True)
class GemmTile:
    """The tile of one expert GEMM: ``block_n`` weight rows by ``block_k`` along K per step.

    ``swap_ab`` computes the transposed tile (weight rows on the MMA's M side), which suits
    blocks of a few tokens. FP8 weights need ``block_k == 128``; with an e4m3 intermediate the
    gate/up GEMM needs ``block_n == 128`` (one quantisation group per program).
    """

    block_n: int
    block_k: int = SCALE_BLOCK
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False


@dataclass(frozen=True)
class MoEConfig:
    """``block_m``: rows of one expert per block (the alignment unit, shared by both GEMMs)."""

    block_m: int
    gate_up: GemmTile
    down: GemmTile

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> MoEConfig:
        return MoEConfig(d["block_m"], GemmTile(**d["gate_up"]), GemmTile(**d["down"]))


def config_file_name(experts: int, inter: int, hidden: int, device: str, fp8: bool) -> str:
    """The table's file name for one shape, device (``torch.cuda.get_device_name``) and dtype."""
    dev = device.replace(" ", "_").replace("/", "_")
    return f"E={experts},N={inter},K={hidden},device={dev},dtype={'fp8' if fp8 else 'bf16'}.json"


@functools.cache
def load_table(path: Path) -> dict[int, MoEConfig] | None:
    """The table in ``path`` keyed by token count, or None when there is no such file."""
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return {int(t): MoEConfig.from_json(c) for t, c in raw.items()}


def default_config(tokens: int, experts: int, top_k: int, fp8: bool) -> MoEConfig:
    """A config that compiles on Hopper (at most ~120 KB of shared memory) and is sane for the
    expected rows per expert ``r = T * top_k / E``: 16-row blocks with swapped operands while
    experts see a few tokens each (decode), 32-row blocks up to r = 32, else 64-row blocks."""
    bk = SCALE_BLOCK if fp8 else 64
    rows = tokens * top_k / max(experts, 1)
    if rows <= 32:
        bm = 16 if rows <= 8 else 32
        return MoEConfig(bm, GemmTile(128, bk, 4, 3, True), GemmTile(64, bk, 4, 3, True))
    return MoEConfig(64, GemmTile(128, bk, 8, 3, False), GemmTile(128, bk, 4, 3, False))


def pick_from_table(table: dict[int, MoEConfig], tokens: int) -> MoEConfig:
    """The entry of the smallest token count >= ``tokens``, else the largest one."""
    at_or_above = [t for t in table if t >= tokens]
    return table[min(at_or_above) if at_or_above else max(table)]


def get_config(
    tokens: int, experts: int, inter: int, hidden: int, top_k: int, fp8: bool, device: str
) -> MoEConfig:
    """The tuned config for this shape and device if a table exists, else the default."""
    table = load_table(CONFIG_DIR / config_file_name(experts, inter, hidden, device, fp8))
    if table:
        return pick_from_table(table, tokens)
    return default_config(tokens, experts, top_k, fp8)
