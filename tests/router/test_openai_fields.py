"""Every request field of OpenAI's chat-completions and completions schemas is honoured or
refused with 400: never accepted and ignored.

The fields come from the installed ``openai`` package's typed request parameters, so a
field OpenAI adds fails ``test_every_openai_field_is_classified`` until it is given a
place here. HONOURED names, per field, the behaviour tests that show it working
(``module::test``, checked to exist); the sampling fields are also checked to reach the
engine's SamplingParams through the router's one validation path. REFUSED fields come
from ``router/api/openai_fields.py`` (plus those ``unsupported()`` refuses) and are each sent
once, with a value the server cannot honour, to a real HTTP server.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from openai_api_util import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MODEL,
    Served,
    served_fixture,  # noqa: F401 (fixture served)
)

from router.api.openai_fields import REFUSED

try:
    import httpx
except ImportError:  # this environment ships the client under its new name
    import httpx2 as httpx  # type: ignore[no-redef]

API = "test_openai_api"
ERRORS = "test_openai_api_errors::test_bad_input_gets_openai_error"
CONTROLS = "test_openai_sampling_controls"
SAMPLER = "test_sampler"
GREEDY = f"{API}::test_greedy_chat_stream_equals_whole_and_offline"
TOOLS = "test_chat_tools"
MAPPED = "test_openai_fields::test_sampling_fields_reach_the_engine"

_COMMON: dict[str, list[str]] = {
    "model": [f"{API}::test_models_and_health", ERRORS],
    "n": [f"{API}::test_n2_with_seed_is_reproducible"],
    "seed": [f"{API}::test_n2_with_seed_is_reproducible"],
    "temperature": [GREEDY, f"{SAMPLER}::test_temperature_sampling_fits_softmax", MAPPED],
    "top_p": [f"{SAMPLER}::test_top_k_top_p_min_p_fit_reference", MAPPED],
    "frequency_penalty": [f"{SAMPLER}::test_penalties_match_python_reference", MAPPED],
    "presence_penalty": [f"{SAMPLER}::test_penalties_match_python_reference", MAPPED],
    "stop": [f"{API}::test_stop_strings"],
    "stream": [GREEDY],
    "stream_options": [GREEDY, ERRORS],
    "logit_bias": [f"{CONTROLS}::test_logit_bias_bans_and_forces_tokens", MAPPED],
    "max_tokens": [GREEDY, ERRORS],
    "user": ["test_openai_fields::test_user_is_accepted_and_changes_nothing"],  # ignored
}
HONOURED: dict[str, dict[str, list[str]]] = {
    "chat": _COMMON
    | {
        "messages": [GREEDY],
        "max_completion_tokens": [MAPPED, ERRORS],
        "logprobs": [f"{API}::test_chat_logprobs_shapes"],
        "top_logprobs": [f"{API}::test_chat_logprobs_shapes"],
        "tools": [
            f"{TOOLS}::test_auto_call_whole_and_streamed",
            f"{TOOLS}::test_tools_reach_the_prompt_through_the_template",
        ],
        "tool_choice": [
            f"{TOOLS}::test_forced_tool_choice_yields_a_call_that_validates",
            f"{TOOLS}::test_tool_choice_none_leaves_tools_out",
        ],
        "parallel_tool_calls": [f"{TOOLS}::test_parallel_calls_and_parallel_tool_calls_false"],
        "response_format": [
            f"{CONTROLS}::test_json_schema_outputs_always_validate",
            f"{CONTROLS}::test_json_object_regex_and_ebnf",
            "test_serving_pd::test_json_schema_outputs_validate_through_pd",
            "test_serving_spec_pd::test_json_schema_outputs_validate_with_mtp",
        ],
    },
    "completion": _COMMON
    | {
        "prompt": [f"{API}::test_completion_token_prompt_and_logprobs"],
        "logprobs": [f"{API}::test_completion_token_prompt_and_logprobs"],
        "echo": [f"{CONTROLS}::test_completions_echo"],  # refused with logprobs (no prompt ones)
    },
}
REFUSED_BY_REQUEST: dict[str, set[str]] = {"completion": {"suffix"}}

# A value of each refused field that asks for something the server does not do.
REFUSED_VALUES: dict[str, Any] = {
    "prompt_logprobs": 1,
    "audio": {"voice": "alloy", "format": "mp3"},
    "modalities": ["text", "audio"],
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "metadata": {"k": "v"},
    "store": True,
    "moderation": {"model": "omni-moderation-latest"},
    "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "auto"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "safety_identifier": "s",
    "service_tier": "flex",
    "verbosity": "low",
    "web_search_options": {},
    "best_of": 2,
    "suffix": "the end",
    # vLLM's and SGLang's extensions
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'root ::= "a"',
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
    "structured_outputs": {"choice": ["yes", "no"]},
    "structural_tag": '{"type": "structural_tag"}',
    "json_schema": '{"type": "object"}',
    "bad_words": ["hi"],
    "allowed_token_ids": [1, 2],
    "truncate_prompt_tokens": 4,
    "include_stop_str_in_output": True,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
    "return_tokens_as_token_ids": True,
    "return_hidden_states": True,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "priority": 1,
    "lora_request": {"lora_name": "a"},
    "lora_path": "a",
    "kv_transfer_params": {"do_remote_decode": True},
    "mm_processor_kwargs": {"size": 1},
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
    "documents": [{"text": "doc"}],
}
# Values that ask for nothing beyond what the server does: accepted.
NO_OP_VALUES: list[tuple[str, str, Any]] = [
    ("chat", "store", False),
    ("chat", "service_tier", "auto"),
    ("chat", "modalities", ["text"]),
    ("completion", "best_of", 1),
    ("chat", "echo", False),
    ("chat", "add_generation_prompt", True),
    ("completion", "include_stop_str_in_output", False),
    ("completion", "priority", 0),
]


def openai_fields(kind: str) -> set[str]:
    """The request fields of the installed openai package's typed params for ``kind``."""
    module = chat_params if kind == "chat" else completion_params
    fields: set[str] = set()
    for params in (
        module.CompletionCreateParamsNonStreaming,
        module.CompletionCreateParamsStreaming,
    ):
        fields |= params.__required_keys__ | params.__optional_keys__
    return fields


def refused(kind: str) -> set[str]:
    return set(REFUSED[kind]) | REFUSED_BY_REQUEST.get(kind, set())


def request(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    if kind == "chat":
        return CHAT_PATH, base | {"messages": [{"role": "user", "content": "hi"}]} | fields
    return COMPLETIONS_PATH, base | {"prompt": "hi"} | fields


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_openai_field_is_classified(kind: str) -> None:
    fields = openai_fields(kind)
    assert "messages" in fields if kind == "chat" else "prompt" in fields  # read the schema
    honoured, refused_ = set(HONOURED[kind]), refused(kind)
    assert not honoured & refused_, "a field is both honoured and refused"
    missing = fields - honoured - refused_
    assert not missing, f"OpenAI {kind} fields neither honoured nor refused: {sorted(missing)}"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_honoured_fields_name_existing_behaviour_tests(kind: str) -> None:
    for field, tests in HONOURED[kind].items():
        assert tests, f"{field}: no behaviour test named"
        for ref in tests:
            module, name = ref.split("::")
            assert callable(getattr(importlib.import_module(module), name, None)), (field, ref)


REFUSED_CASES = [
    (kind, field) for kind in ("chat", "completion") for field in sorted(refused(kind))
]


@pytest.mark.parametrize(("kind", "field"), REFUSED_CASES)
def test_refused_fields_get_400(served: Served, kind: str, field: str) -> None:
    path, body = request(kind, **{field: REFUSED_VALUES[field]})
    response = httpx.post(served.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"], error


@pytest.mark.parametrize(("kind", "field", "value"), NO_OP_VALUES)
def test_no_op_values_are_accepted(served: Served, kind: str, field: str, value: Any) -> None:
    path, body = request(kind, **{field: value})
    response = httpx.post(served.url + path, json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_user_is_accepted_and_changes_nothing(served: Served) -> None:
    client = served.client()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    chat |= {"temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(**chat).choices[0].message.content
    assert client.chat.completions.create(**chat, user="u-1").choices[0].message.content == plain
    legacy = {"model": MODEL, "prompt": "hi", "max_tokens": 6, "temperature": 0}
    text = client.completions.create(**legacy).choices[0].text
    assert client.completions.create(**legacy, user="u-1").choices[0].text == text
    bad = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": 5}  # not a string
    response = httpx.post(served.url + "/v1/completions", json=bad, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "user"


def test_sampling_fields_reach_the_engine(served: Served) -> None:
    """The router's validation path maps each sampling field onto SamplingParams."""
    fields = {
        "temperature": 0.5,
        "top_p": 0.25,
        "frequency_penalty": 1.5,
        "presence_penalty": -0.5,
        "logit_bias": {"11": -7.5},
        "max_completion_tokens": 9,
    }
    params = served.server.prepare(request("chat", **fields)[1], "chat").request.params
    assert (params.temperature, params.top_p) == (0.5, 0.25)
    assert (params.frequency_penalty, params.presence_penalty) == (1.5, -0.5)
    assert params.logit_bias == {11: -7.5} and params.max_new_tokens == 9
