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
    normalize_device_name,
    pick_from_table,
    shape_key,
    shared_fusion_max_tokens,
    write_shared_fusion,
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


def test_device_names_normalise_as_the_tuner_writes_them() -> None:
    assert normalize_device_name("NVIDIA H200") == "NVIDIA_H200"
    assert normalize_device_name("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100-SXM4-80GB"
    assert normalize_device_name(" NVIDIA  H100 80GB/HBM3") == "NVIDIA_H100_80GB_HBM3"


def test_h200_table_is_found_by_the_cuda_device_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synthetic table named as the tuner names it on an H200, for the fused E=257 stack."""
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    table = _write_table(tmp_path, "E=257,N=2048,K=7168,device=NVIDIA_H200,dtype=fp8.json")
    assert get_config(100, 257, 2048, 7168, 9, True, "NVIDIA H200") == table[256]
    assert get_config(100, 256, 2048, 7168, 8, True, "NVIDIA H200") == default_config(
        100, 256, 8, True
    )
    assert get_config(100, 257, 2048, 7168, 9, False, "NVIDIA H200") == default_config(
        100, 257, 9, False
    )


def test_shared_fusion_measurement_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    assert shared_fusion_max_tokens(256, 2048, 7168, "NVIDIA H200", True) == -1  # no file
    path = tmp_path / moe_config.SHARED_FUSION_FILE
    write_shared_fusion(path, shape_key(256, 2048, 7168, "NVIDIA H200", True), 512)
    write_shared_fusion(path, shape_key(256, 2048, 7168, "NVIDIA H100 80GB HBM3", True), 64)
    assert json.loads(path.read_text()) == {
        "E=256,N=2048,K=7168,device=NVIDIA_H100_80GB_HBM3,dtype=fp8": 64,
        "E=256,N=2048,K=7168,device=NVIDIA_H200,dtype=fp8": 512,
    }
    assert shared_fusion_max_tokens(256, 2048, 7168, "NVIDIA H200", True) == 512
    assert shared_fusion_max_tokens(256, 2048, 7168, "NVIDIA H200", False) == -1
    assert shared_fusion_max_tokens(256, 1024, 7168, "NVIDIA H200", True) == -1
