"""The measured DeepGEMM tables (dsv3serve/kernels/gemm_table.py) and the backend ranges
printed from them (gemm_routes.py): the rule on a table of cases, files written and read
back, and the M ranges against the dispatch asked at every M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv3serve.kernels.fp8_gemm import choose_backend
from dsv3serve.kernels.gemm_routes import backend_ranges, format_ranges
from dsv3serve.kernels.gemm_table import (
    MIN_SPEEDUP,
    Measured,
    load_table,
    normalize_device_name,
    parse_table,
    shipped_devices,
    table_path,
    wins,
    write_section,
)


def _pts(*speedups: tuple[int, float]) -> tuple[Measured, ...]:
    return tuple(Measured(m, 100.0, "cublas", 100.0 * s) for m, s in speedups)


@pytest.mark.parametrize(
    ("points", "m", "expected"),
    [
        (_pts(), 1024, False),  # nothing measured
        (_pts((1024, 1.2)), 1024, True),
        (_pts((1024, MIN_SPEEDUP)), 1024, True),  # the threshold itself counts
        (_pts((1024, 1.04)), 1024, False),
        (_pts((1024, 1.2)), 1023, False),  # outside the measured range
        (_pts((1024, 1.2)), 1025, False),
        (_pts((1024, 1.2), (2048, 1.3)), 1500, True),
        (_pts((1024, 1.2), (2048, 1.0)), 1500, False),  # one side lost
        (_pts((1024, 1.0), (2048, 1.3)), 2048, True),  # a measured point decides alone
        (_pts((64, 1.1), (1024, 0.9), (2048, 1.3)), 100, False),
    ],
)
def test_wins(points: tuple[Measured, ...], m: int, expected: bool) -> None:
    assert wins(points, m) is expected


def test_device_names_and_paths() -> None:
    assert normalize_device_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert table_path("NVIDIA H200").name == "deepgemm,device=NVIDIA_H200.json"


def test_write_then_load_keeps_other_entries(tmp_path: Path) -> None:
    env = {"gpu": "NVIDIA H200", "date": "2026-12-06"}
    path = table_path("NVIDIA H200", tmp_path)
    write_section(path, "dense", {"N=7168,K=2048": list(_pts((1024, 1.2), (64, 0.5)))}, env)
    write_section(path, "dense", {"N=2112,K=7168": list(_pts((512, 1.1)))}, env)
    write_section(path, "masked", {"E=32,N=2048,K=7168,M=1024": list(_pts((64, 1.3)))}, env)
    table = load_table("NVIDIA H200", tmp_path)
    assert table is not None and table.environment == env
    assert [p.m for p in table.points("dense", "N=7168,K=2048")] == [64, 1024]
    assert table.dense_wins(1024, 7168, 2048) and table.dense_wins(512, 2112, 7168)
    assert not table.dense_wins(64, 7168, 2048)
    assert table.points("masked", "E=32,N=2048,K=7168,M=1024")[0].speedup == pytest.approx(1.3)
    assert shipped_devices(tmp_path) == ["NVIDIA_H200"]
    assert load_table("NVIDIA A100", tmp_path) is None


def test_unknown_sections_are_refused() -> None:
    with pytest.raises(ValueError, match="found \\['grouped'\\]"):
        parse_table("NVIDIA H200", {"grouped": {}})


def test_shipped_tables_parse() -> None:
    for device in shipped_devices():
        assert load_table(device) is not None, device
        json.loads(table_path(device).read_text())


def _brute(n: int, k: int, max_m: int, table) -> list[str]:  # noqa: ANN001
    return [choose_backend(m, n, k, table.dense_wins(m, n, k)) for m in range(1, max_m + 1)]


@pytest.mark.parametrize(("n", "k"), [(7168, 2048), (2112, 7168), (7168, 2304)])
def test_ranges_match_the_dispatch_at_every_m(n: int, k: int) -> None:
    key = f"N={n},K={k}"
    raw = {m: {"deepgemm_us": 1.0, "baseline": "x", "baseline_us": s}
           for m, s in [(64, 1.2), (128, 1.0), (256, 1.1), (1024, 1.3), (2048, 1.3)]}  # fmt: skip
    table = parse_table("g", {"dense": {key: {str(m): r for m, r in raw.items()}}})
    ranges = backend_ranges(n, k, 3000, table, True)
    flat = [b for lo, hi, b in ranges for _ in range(lo, hi + 1)]
    assert flat == _brute(n, k, 3000, table)
    assert ranges[0][0] == 1 and ranges[-1][1] == 3000
    assert "deepgemm M 64" in format_ranges(ranges)
    no_dg = backend_ranges(n, k, 3000, table, False)
    assert all(b != "deepgemm" for _, _, b in no_dg)
