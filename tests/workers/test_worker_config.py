"""WorkerConfig: one replica's settings, validated once (group size = engine.tp_size, the
refusals of layouts a role cannot run, speculation vs multi-rank groups)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dsv3serve.engine.config import EngineConfig
from workers.config import WorkerConfig

SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
SPEC_ENGINE = EngineConfig(model="tiny", **SPEC)
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2}


@pytest.mark.parametrize("tp_size", [1, 2, 8])
def test_group_size_is_the_engine_tp_size(tp_size: int) -> None:
    engine = EngineConfig(model="tiny", tp_size=tp_size)
    assert WorkerConfig(role="decode", engine=engine).group_size == tp_size


def test_group_size_cannot_be_set_and_is_not_serialised() -> None:
    with pytest.raises(ValidationError, match="group_size"):
        WorkerConfig(role="decode", engine=EngineConfig(model="tiny"), group_size=2)
    data = WorkerConfig(role="decode", engine=EngineConfig(model="tiny", tp_size=2)).model_dump()
    assert "group_size" not in data and data["engine"]["tp_size"] == 2


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_tp_group_with_speculation_is_accepted(role: str) -> None:
    engine = EngineConfig(model="tiny", tp_size=2, ep_size=2, **SPEC)
    assert WorkerConfig(role=role, engine=engine).group_size == 2


@pytest.mark.parametrize("role", ["decode", "colocated"])
def test_dp_attention_group_with_speculation_is_accepted(role: str) -> None:
    """MTP runs under DP attention (tests/engine/group/test_group_spec.py)."""
    data = {"model": "tiny", **DP_ATTENTION, **SPEC}
    worker = WorkerConfig.model_validate({"role": role, "engine": data})
    assert worker.group_size == 2 and worker.engine.spec_num_steps > 0


def test_prefill_with_dp_attention_is_refused_and_other_roles_accept_it() -> None:
    engine = EngineConfig(model="tiny", **DP_ATTENTION)
    with pytest.raises(ValidationError, match=r"engine\.enable_dp_attention: a prefill group"):
        WorkerConfig(role="prefill", engine=engine)
    for role in ("decode", "colocated"):
        assert WorkerConfig(role=role, engine=engine).engine.parallel.attn_tp_size == 1


def test_the_rules_hold_for_the_json_a_replica_is_started_with() -> None:
    data = WorkerConfig(role="decode", engine=SPEC_ENGINE).model_dump(mode="json")
    data["engine"].update(DP_ATTENTION | {"tp_size": 4, "ep_size": 4})  # dp_size 2 != tp_size
    with pytest.raises(ValidationError, match="enable_dp_attention"):
        WorkerConfig.model_validate_json(json.dumps(data))
    data["engine"]["dp_size"] = 4
    assert WorkerConfig.model_validate_json(json.dumps(data)).group_size == 4
    dp = WorkerConfig(role="decode", engine=EngineConfig(model="tiny", **DP_ATTENTION))
    as_prefill = {**dp.model_dump(mode="json"), "role": "prefill"}
    with pytest.raises(ValidationError, match="a prefill group"):
        WorkerConfig.model_validate_json(json.dumps(as_prefill))
