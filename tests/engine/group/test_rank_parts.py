"""rank_parts: a group rank's layout, the refusal without a process group, the fit check,
the ranks on one host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv3serve.config import ModelConfig
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.group.rank_parts import check_fits, rank_parts, ranks_on_this_host
from dsv3serve.model.presets import PRESETS
from dsv3serve.parallel.config import LayoutError
from dsv3serve.plan.planner import PlanError

V3 = ModelConfig.from_dict(PRESETS["deepseek-v3"])


def test_one_rank_needs_no_group() -> None:
    parts = rank_parts(EngineConfig(model="tiny"), V3)
    assert not parts.in_group and parts.comm is None


def test_one_rank_is_alone_on_its_host() -> None:
    """Without a group no collective runs; a group's count is checked by the DP2 + EP2 group
    in test_group_kv_budget.py."""
    assert ranks_on_this_host() == 1


def test_a_group_rank_without_a_process_group_is_refused() -> None:
    cfg = EngineConfig(model="tiny", tp_size=2, ep_size=2)
    with pytest.raises(LayoutError, match="tp_size 2: expected every rank to have joined"):
        rank_parts(cfg, V3)


def test_a_gpu_rank_refuses_a_layout_the_planner_refuses(monkeypatch) -> None:
    """No GPU here: the device's size is faked (80 GB, an H100); the planner is real."""
    fake = SimpleNamespace(total_memory=80 * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _device: fake)
    cuda = torch.device("cuda", 0)
    with pytest.raises(PlanError, match="GB"):
        check_fits(EngineConfig(model="deepseek-v3", load_format="dummy", tp_size=8), V3, cuda)
    dp16 = {"tp_size": 16, "dp_size": 16, "enable_dp_attention": True, "ep_size": 16}
    check_fits(EngineConfig(model="deepseek-v3", load_format="dummy", **dp16), V3, cuda)
