"""``bench kernels --only fused`` on the CPU: its flags, its section name and its table
(timing needs a GPU: benchmarks/run_speed_gpu.sh runs it)."""

from __future__ import annotations

import argparse

from dsv3serve.bench.kernels.fused import FUSED_ROWS, KERNELS, add_fused_args, print_fused
from dsv3serve.bench.kernels.run import parse_sections


def test_defaults_time_every_fused_kernel_at_decode_rows() -> None:
    p = argparse.ArgumentParser()
    add_fused_args(p)
    assert p.parse_args([]).fused_rows == list(FUSED_ROWS) == [1, 64]
    assert p.parse_args(["--fused-rows", "8"]).fused_rows == [8]
    assert list(KERNELS) == ["norm_quant", "mla_norm", "rope_kv"]
    assert parse_sections("mla,fused") == ["mla", "fused"]


def test_table_gives_each_row_its_bandwidth_and_the_references_time_over_its_own(
    capsys,
) -> None:
    row = {"kernel": "norm_quant", "rows": 64, "us": 4.0, "ref_us": 30.0, "GBps": 2500.0}
    print_fused([row])
    assert capsys.readouterr().out.splitlines()[-1].split() == [
        "norm_quant", "64", "4.00", "2500.0", "30.00", "7.50"
    ]  # fmt: skip
