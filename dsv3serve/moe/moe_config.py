"""Launch configurations of the fused Triton MoE: tuned JSON tables, else a default rule.

A table is one JSON file per (experts E, intermediate size N, hidden size K, device, weight
dtype), written by ``python -m dsv3serve.bench.kernels.moe_tune``, named like
``E=256,N=2048,K=7168,device=NVIDIA_H100_80GB_HBM3,dtype=fp8.json`` and kept in
``dsv3serve/moe/configs/``. It maps a token count T (the batch's rows) to a
:class:`MoEConfig`; a batch uses the entry of the smallest T at or above its own (the largest
entry past the end). Without a table, :func:`default_config` picks by the expected rows per
expert. With the shared expert fused (:mod:`dsv3serve.moe.shared`) the stack has E + 1
experts and its table is E=257's.

``configs/shared_fusion.json`` maps the same key (without ``.json``) to the largest token
count at which the fused shared expert was measured faster than the separate one.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsv3serve.json_types import JSONObject, json_int, json_object

CONFIG_DIR = Path(__file__).parent / "configs"
SHARED_FUSION_FILE = "shared_fusion.json"
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

    def to_json(self) -> JSONObject:
        return asdict(self)

    @staticmethod
    def from_json(d: JSONObject) -> MoEConfig:
        gate_up = json_object(d["gate_up"], "gate_up")
        down = json_object(d["down"], "down")
        return MoEConfig(json_int(d["block_m"], "block_m"), _tile(gate_up), _tile(down))


def _tile(d: JSONObject) -> GemmTile:
    """A :class:`GemmTile` from its JSON fields, each an int (``swap_ab`` a bool, one too)."""
    checked: dict[str, Any] = {k: json_int(v, k) for k, v in d.items()}
    return GemmTile(**checked)


def normalize_device_name(device: str) -> str:
    """``"NVIDIA H200"`` -> ``"NVIDIA_H200"``: runs of spaces and slashes become one underscore
    (as vLLM names its tables, e.g. ``NVIDIA_H100_80GB_HBM3``, ``NVIDIA_A100-SXM4-80GB``)."""
    return "_".join(device.replace("/", " ").split())


def shape_key(experts: int, inter: int, hidden: int, device: str, fp8: bool) -> str:
    """``E=..,N=..,K=..,device=..,dtype=..`` for one shape, device and weight dtype."""
    dev = normalize_device_name(device)
    return f"E={experts},N={inter},K={hidden},device={dev},dtype={'fp8' if fp8 else 'bf16'}"


def config_file_name(experts: int, inter: int, hidden: int, device: str, fp8: bool) -> str:
    """The table's file name for one shape, device (``torch.cuda.get_device_name``) and dtype."""
    return shape_key(experts, inter, hidden, device, fp8) + ".json"


@functools.cache
def load_shared_fusion(path: Path) -> dict[str, int]:
    """``configs/shared_fusion.json``: shape key -> largest token count run fused ({} if none)."""
    if not path.is_file():
        return {}
    return {k: int(v) for k, v in json.loads(path.read_text()).items()}


def shared_fusion_max_tokens(experts: int, inter: int, hidden: int, device: str, fp8: bool) -> int:
    """The measured largest token count at which fusing the shared expert was faster for
    ``experts`` routed experts, or -1 when there is no measurement for this shape and GPU."""
    table = load_shared_fusion(CONFIG_DIR / SHARED_FUSION_FILE)
    return table.get(shape_key(experts, inter, hidden, device, fp8), -1)


def write_shared_fusion(path: Path, key: str, max_tokens: int) -> None:
    """Set one entry of a shared-fusion file (other entries kept)."""
    table = json.loads(path.read_text()) if path.is_file() else {}
    table[key] = max_tokens
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    load_shared_fusion.cache_clear()


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
