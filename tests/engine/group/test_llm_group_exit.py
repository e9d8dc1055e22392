"""Leaving ``with LLM(..., tp_size=2)`` on an error: the error that ended the block is the
one the caller sees, and no follower process is left behind, even when a follower can no
longer answer rank 0 (a dead one here; on a GPU, one stuck in a collective)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv3serve.engine.llm import LLM


class ScenarioError(Exception):
    """The error the ``with`` body raises."""


def test_an_error_in_the_block_propagates_and_the_followers_are_gone(tiny_bf16_dir: Path) -> None:
    llm = LLM(str(tiny_bf16_dir), tp_size=2, num_kv_tokens=256)
    followers = list(llm._group.processes)
    with pytest.raises(ScenarioError), llm:
        followers[0].kill()  # rank 0 can no longer reach it: STOP would fail
        followers[0].join(10)
        raise ScenarioError("the caller's own failure")
    assert all(not p.is_alive() for p in followers)
    assert llm._group is None


def test_a_clean_exit_still_stops_the_followers(tiny_bf16_dir: Path) -> None:
    with LLM(str(tiny_bf16_dir), tp_size=2, num_kv_tokens=256) as llm:
        followers = list(llm._group.processes)
    assert all(p.exitcode == 0 for p in followers)
