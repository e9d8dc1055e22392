"""SamplingParams: defaults, accepted boundaries, and one clear error per bad field."""

from __future__ import annotations

from typing import Any

import pytest

from dsv3serve.sampling.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_match_vllm_names() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, -1)
    assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)
    assert (params.frequency_penalty, params.presence_penalty) == (0.0, 0.0)
    assert (params.seed, params.max_new_tokens, params.min_new_tokens) == (None, 128, 0)
    assert (params.stop, params.stop_token_ids, params.logprobs) == ([], [], None)
    assert not params.ignore_eos and params.skip_special_tokens
    assert not params.is_greedy and not params.has_penalties and not params.top_k_enabled


def test_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]


def test_is_greedy_only_at_zero_temperature() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_is_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(ValueError):
        params.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-3},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"min_new_tokens": 7, "max_new_tokens": 7},
        {"seed": 0},
        {"seed": -(2**63)},
        {"seed": 2**63 - 1},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


@pytest.mark.parametrize(
    ("kwargs", "field", "found", "allowed"),
    [
        ({"temperature": -0.1}, "temperature", "-0.1", ">= 0"),
        ({"temperature": float("nan")}, "temperature", "nan", "finite"),
        ({"top_p": 0.0}, "top_p", "0.0", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "1.5", "(0, 1]"),
        ({"top_k": -2}, "top_k", "-2", "-1 or 0"),
        ({"min_p": -0.5}, "min_p", "-0.5", "[0, 1]"),
        ({"min_p": 1.01}, "min_p", "1.01", "[0, 1]"),
        ({"n": 0}, "n", "0", ">= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens", "0", ">= 1"),
        ({"min_new_tokens": -1}, "min_new_tokens", "-1", ">= 0"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens", "9", "<= max_new_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0", "> 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0", "> 0"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "2.5", "[-2, 2]"),
        ({"presence_penalty": -2.01}, "presence_penalty", "-2.01", "[-2, 2]"),
        ({"logprobs": -1}, "logprobs", "-1", "[0, 20]"),
        ({"logprobs": 21}, "logprobs", "21", "[0, 20]"),
        ({"stop": ""}, "stop", "''", "non-empty"),
        ({"stop": ["ok", ""]}, "stop", "['ok', '']", "non-empty"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", "[3, -1]", ">= 0"),
        ({"seed": 2**63}, "seed", str(2**63), "64-bit signed"),
        ({"seed": -(2**63) - 1}, "seed", str(-(2**63) - 1), "64-bit signed"),
        ({"temperature": "hot"}, "temperature", "'hot'", "valid number"),
        ({"top_pp": 0.9}, "top_pp", "0.9", "not permitted"),
    ],
)
def test_invalid_value_names_field_value_and_rule(
    kwargs: dict[str, Any], field: str, found: str, allowed: str
) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    message = str(info.value)
    assert field in message and found in message and allowed in message, message


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(temperature=-1.0, top_p=2.0)
    assert "temperature" in str(info.value) and "top_p" in str(info.value)
