"""WorkerConfig: one replica's settings, validated once (here: speculation vs groups)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dsv3serve.engine.config import EngineConfig
from workers.config import WorkerConfig

SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
SPEC_ENGINE = EngineConfig(model="tiny", **SPEC)
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2}


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_tp_group_with_speculation_is_accepted(role: str) -> None:
    engine = EngineConfig(model="tiny", tp_size=2, ep_size=2, **SPEC)
    assert WorkerConfig(role=role, engine=engine).group_size == 2


@pytest.mark.parametrize("role", ["decode", "colocated"])
def test_dp_attention_group_with_speculation_is_rejected_naming_both(role: str) -> None:
    data = {"model": "tiny", **DP_ATTENTION, **SPEC}
    with pytest.raises(ValidationError) as err:
        WorkerConfig.model_validate({"role": role, "engine": data})
    assert "speculative_algorithm with enable_dp_attention is not built yet" in str(err.value)


def test_one_rank_with_speculation_and_groups_without_it_are_accepted() -> None:
    assert WorkerConfig(role="decode", engine=SPEC_ENGINE).group_size == 1
    plain = EngineConfig(model="tiny", tp_size=8, ep_size=8)
    assert WorkerConfig(role="decode", engine=plain).group_size == 8


def test_the_rule_holds_for_the_json_a_replica_is_started_with() -> None:
    data = WorkerConfig(role="decode", engine=SPEC_ENGINE).model_dump(mode="json")
    data["engine"].update(DP_ATTENTION)
    with pytest.raises(ValidationError, match="enable_dp_attention"):
        WorkerConfig.model_validate_json(json.dumps(data))
    data["engine"]["enable_dp_attention"], data["engine"]["dp_size"] = False, 1
    assert WorkerConfig.model_validate_json(json.dumps(data)).group_size == 2
