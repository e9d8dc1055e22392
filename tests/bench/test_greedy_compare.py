"""dsv3serve.bench.engine.greedy_compare: the verdicts docs/perf/serve_gpu.md reports."""

from __future__ import annotations

from dsv3serve.bench.engine.greedy_compare import compare, first_difference, same_input_gap, spread

REF = {"a": [1, 2, 3], "b": [4, 5]}
REF_TOP = {"a": [{1: -1.0, 9: -1.2}, {2: -0.5}, {3: -0.1}], "b": [{4: -2.0}, {5: -0.3}]}


def test_equal_runs_are_equal() -> None:
    got = compare(REF, REF_TOP, REF, REF_TOP, ref_spread=0.1)
    assert got["equal"] and got["verdict"] == "equal"
    assert got["matching_tokens"] == got["reference_tokens"] == 5


def test_a_divergence_is_judged_by_the_gap_at_positions_with_the_same_inputs() -> None:
    tokens = {"a": [9, 7, 7], "b": [4, 5]}  # parts at position 0 of "a"
    near = {"a": [{1: -1.05, 9: -1.0}], "b": REF_TOP["b"]}  # 1 moved by 0.05
    far = {"a": [{1: -3.0, 9: -1.0}], "b": REF_TOP["b"]}  # 1 moved by 2.0
    within = compare(tokens, near, REF, REF_TOP, ref_spread=0.1)
    assert within["divergences"] == [{"request": "a", "position": 0}]
    assert within["verdict"] == "diverged within the engine's spread"
    beyond = compare(tokens, far, REF, REF_TOP, ref_spread=0.1)
    assert beyond["verdict"] == "diverged beyond the engine's spread"
    assert beyond["same_input_logprob_gap"] == 2.0


def test_a_missing_token_is_a_difference_and_spread_is_the_largest_gap() -> None:
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert same_input_gap([{1: -1.0}], [{1: -1.5}, {2: -9.0}], 1) == 0.5
    other = ({"a": [1, 2, 3], "b": [4, 5]}, {"a": [{1: -1.25}], "b": [{4: -2.0}]})
    assert spread(REF, REF_TOP, [other]) == 0.25
