"""DeepEP's buffer sizes in the planner (``moe_a2a_backend`` ``deepep``): counted in the
plan, shown in the table, and a layout whose low-latency buffers do not fit is refused with
the field to change. The size formulas themselves are checked against the built ``deep_ep``
library's own hints on a GPU machine (``test_deepep_sizes_gpu.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsv3serve.config import ModelConfig
from dsv3serve.model.presets import DEEPSEEK_V3_CONFIG
from dsv3serve.parallel.config import ParallelConfig
from dsv3serve.parallel.deepep_sizes import deepep_bytes, low_latency_rdma_bytes
from dsv3serve.plan.planner import GB, PlanError, plan

V3 = ModelConfig.from_dict(DEEPSEEK_V3_CONFIG)


def deepep(n: int, mode: str = "auto") -> ParallelConfig:
    return ParallelConfig(
        tp_size=n, dp_size=n, enable_dp_attention=True, ep_size=n,
        moe_a2a_backend="deepep", deepep_mode=mode,
    )  # fmt: skip


def test_low_latency_buffer_is_four_slabs_of_every_expert_times_the_bound() -> None:
    """DeepEP's layout: two send and two receive buffers of experts x tokens messages
    (14,560 bytes per combine message at hidden 7168), so the size is linear in the per-rank
    bound and not in max_num_batched_tokens: 3.8 GB at 256 tokens, 244 GB at 16,384."""
    at_256 = low_latency_rdma_bytes(256, 7168, 256)
    assert at_256 == pytest.approx(4 * 256 * 256 * 14_560, rel=1e-3)
    assert low_latency_rdma_bytes(16_384, 7168, 256) / at_256 == pytest.approx(64, rel=1e-3)


def test_modes_allocate_only_their_buffers() -> None:
    args = (7168, 256, 8, 2048, 128, True)
    normal, low, auto = (deepep_bytes(m, *args) for m in ("normal", "low_latency", "auto"))
    assert normal.rdma == normal.activations == 0 and normal.nvl >= 1 << 28
    assert low.nvl == 0 and low.rdma > 0 and low.activations > 0
    assert auto.total == normal.nvl + low.rdma + low.activations


def test_plan_counts_deepep_and_leaves_the_kv_less() -> None:
    gather = plan(
        V3, ParallelConfig(tp_size=8, dp_size=8, enable_dp_attention=True, ep_size=8), 141
    )
    with_deepep = plan(V3, deepep(8), 141)
    assert gather.deepep is None and with_deepep.deepep is not None
    assert with_deepep.fixed_bytes - gather.fixed_bytes == with_deepep.deepep_bytes
    assert gather.kv_bytes - with_deepep.kv_bytes == pytest.approx(
        with_deepep.deepep_bytes, abs=0.01 * GB
    )
    smaller = plan(V3, deepep(8), 141, max_running_requests=64)
    assert smaller.deepep.rdma == pytest.approx(with_deepep.deepep.rdma / 4, rel=1e-2)


def test_a_bound_whose_buffers_do_not_fit_is_refused_naming_the_field() -> None:
    with pytest.raises(PlanError, match=r"DeepEP buffers .* sized by max_running_requests 4096"):
        plan(V3, deepep(8), 141, max_running_requests=4096)


def test_cli_shows_the_buffers_and_refuses_with_the_field() -> None:
    base = [sys.executable, "-m", "dsv3serve.cli", "plan", "--gpu-memory-gb", "141",
            "--tp-size", "8", "--dp-size", "8", "--enable-dp-attention", "--ep-size", "8",
            "--moe-a2a-backend", "deepep"]  # fmt: skip
    ok = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "DeepEP RDMA (low-lat.)" in ok.stdout and "DeepEP NVLink (normal)" in ok.stdout
    bad = subprocess.run(
        base + ["--max-running-requests", "4096"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "max_running_requests 4096" in bad.stderr
