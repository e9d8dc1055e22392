"""Launch configs of the fused MoE: the default rule, table files and their lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv3serve.moe import moe_config
from dsv3serve.moe.moe_config import (
    GemmTile,
    MoEConfig,
    config_file_name,
    default_config,
    get_config,
    load_table,
    pick_from_table,
)


@pytest.mark.parametrize(
    ("t", "block_m", "swap"), [(1, 16, True), (256, 16, True), (512, 32, True), (4096, 64, False)]
)
def test_default_tiers_at_deepseek_shapes(t: int, block_m: int, swap: bool) -> None:
    cfg = default_config(t, 256, 8, fp8=True)
    assert (cfg.block_m, cfg.gate_up.swap_ab, cfg.down.swap_ab) == (block_m, swap, swap)
    assert cfg.gate_up.block_n == 128 and cfg.gate_up.block_k == cfg.down.block_k == 128
    assert default_config(t, 256, 8, fp8=False).gate_up.block_k == 64


def test_file_name() -> None:
    name = config_file_name(256, 2048, 7168, "NVIDIA H100 80GB HBM3", fp8=True)
    assert name == "E=256,N=2048,K=7168,device=NVIDIA_H100_80GB_HBM3,dtype=fp8.json"


def _write_table(folder: Path, name: str) -> dict[int, MoEConfig]:
    table = {
        8: MoEConfig(16, GemmTile(128, 128, 4, 4, True), GemmTile(64, 128, 4, 5, True)),
        256: MoEConfig(64, GemmTile(128, 128, 8, 3), GemmTile(128, 128, 8, 3)),
    }
    (folder / name).write_text(json.dumps({str(t): c.to_json() for t, c in table.items()}))
    return table


def test_table_round_trip_and_pick(tmp_path: Path) -> None:
    table = _write_table(tmp_path, "t.json")
    assert load_table(tmp_path / "t.json") == table
    assert load_table(tmp_path / "missing.json") is None
    assert [pick_from_table(table, t).block_m for t in (1, 8, 9, 256, 5000)] == [16, 16, 64, 64, 64]


def test_get_config_prefers_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    name = config_file_name(256, 2048, 7168, "GPU X", fp8=True)
    table = _write_table(tmp_path, name)
    assert get_config(3, 256, 2048, 7168, 8, True, "GPU X") == table[8]
    assert get_config(3, 256, 2048, 7168, 8, True, "GPU Y") == default_config(3, 256, 8, True)
