"""WorkerConfig: one replica's settings, validated once (here: speculation vs groups)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from dsv3serve.engine.config import EngineConfig
from workers.config import WorkerConfig

SPEC_ENGINE = EngineConfig(model="tiny", speculative_algorithm="NEXTN", speculative_num_steps=2)


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_group_of_several_ranks_with_speculation_is_rejected_naming_both(role: str) -> None:
    with pytest.raises(ValidationError) as err:
        WorkerConfig(role=role, engine=SPEC_ENGINE, group_size=2)
    (error,) = err.value.errors()
    assert error["loc"] == ("group_size",)
    assert "found 2 with engine.speculative_algorithm NEXTN, expected group_size 1" in str(
        err.value
    )


def test_one_rank_with_speculation_and_groups_without_it_are_accepted() -> None:
    assert WorkerConfig(role="decode", engine=SPEC_ENGINE).group_size == 1
    plain = EngineConfig(model="tiny")
    assert WorkerConfig(role="decode", engine=plain, group_size=8).group_size == 8


def test_the_rule_holds_for_the_json_a_replica_is_started_with() -> None:
    data = WorkerConfig(role="decode", engine=SPEC_ENGINE).model_dump(mode="json")
    with pytest.raises(ValidationError, match="group_size"):
        WorkerConfig.model_validate_json(json.dumps({**data, "group_size": 4}))
