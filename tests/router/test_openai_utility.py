"""What clients coming from vLLM and OpenAI call besides generation, over real HTTP (the
official ``openai`` client where it has a method): ``models.retrieve``, ``HEAD /health``,
``/version``, vLLM's ``/tokenize`` and ``/detokenize``, a list of prompts to
``/v1/completions``. The Serve ingress mounts the same endpoints (and ``/metrics``):
tests/e2e/test_grpc.py calls them on the PD app."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from openai_api_util import (
    CHAT,
    MAX_MODEL_LEN,
    MODEL,
    Served,
    client_fixture,  # noqa: F401 (fixture client)
    served_fixture,  # noqa: F401 (fixture served)
    wait_idle,
)

from router.api.openai_utility import package_version


def post(served: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=60)


def test_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "dsv3serve")
    assert model.model_dump()["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/" + MODEL)  # ids with a slash reach the route


def test_head_health_and_version(served: Served) -> None:
    head = httpx.head(served.url + "/health", timeout=30)
    assert head.status_code == 200 and head.content == b""
    version = httpx.get(served.url + "/version", timeout=30)
    assert version.json() == {"version": package_version()} and package_version() != ""


def test_tokenize_prompt_and_chat_as_generation_sees_them(
    served: Served, client: openai.OpenAI
) -> None:
    tokenizer = served.engine.tokenizer
    plain = post(served, "/tokenize", {"model": MODEL, "prompt": "The sea is"}).json()
    ids = tokenizer.encode("The sea is", add_bos=True)
    assert plain == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                     "token_strs": None}  # fmt: skip
    bare = post(served, "/tokenize", {"prompt": "The sea is", "add_special_tokens": False})
    assert bare.json()["tokens"] == ids[1:]
    chat = post(served, "/tokenize", {"messages": CHAT, "return_token_strs": True}).json()
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens == len(chat["token_strs"])
    assert "".join(chat["token_strs"]) == tokenizer.apply_chat_template(CHAT)
    wait_idle(served)


def test_detokenize_round_trips(served: Served) -> None:
    ids = post(served, "/tokenize", {"prompt": "Hello, world"}).json()["tokens"]
    assert post(served, "/detokenize", {"tokens": ids}).json() == {
        "prompt": "<｜begin▁of▁sentence｜>Hello, world"
    }


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_utility_bad_input_is_a_4xx_error_body(
    served: Served, path: str, body: dict[str, Any], param: str
) -> None:
    response = post(served, path, body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.text


PROMPTS = ["The sea is", "Once upon a time", "1, 2, 3,"]
GREEDY = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(
    served: Served, client: openai.OpenAI
) -> None:
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(2 * len(PROMPTS)))
    alone = [client.completions.create(model=MODEL, prompt=p, **GREEDY) for p in PROMPTS]
    for i, reply in enumerate(alone):
        texts = {batch.choices[2 * i].text, batch.choices[2 * i + 1].text}
        assert texts == {reply.choices[0].text}, (i, texts)  # greedy: both samples alike
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert batch.usage.completion_tokens == 2 * sum(r.usage.completion_tokens for r in alone)
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], **GREEDY)
    assert [c.index for c in ids.choices] == [0, 1]
    wait_idle(served)


def test_a_streamed_list_of_prompts_is_refused(served: Served) -> None:
    body = {"model": MODEL, "prompt": PROMPTS, "stream": True, "max_tokens": 2}
    response = post(served, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    bad = post(served, "/v1/completions", {"model": MODEL, "prompt": ["ok", ""]})
    assert bad.status_code == 400, bad.text  # every prompt is checked before any runs
    wait_idle(served)


def test_a_list_longer_than_the_router_admits_is_a_400_not_a_429(served: Served) -> None:
    """Each prompt takes an admission slot: a list over max_in_flight could never run,
    so a 429 (retry later) would be retried for ever."""
    limit = served.server.config.max_in_flight
    body = {"model": MODEL, "prompt": ["a"] * (limit + 1), "max_tokens": 1}
    response = post(served, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert str(limit) in response.json()["error"]["message"]
    wait_idle(served)
