"""``reasoning_content`` and ``reasoning_tokens`` over HTTP with the official openai client.

The R1-style runs use the published DeepSeek-R1 tokenizer and template (the prompt opens
``<think>``; ``</think>`` is one token, id 128799, which gives an independent count of the
reasoning tokens). A FakeScriptedBackend writes the output where it must contain
``</think>``; the tiny engine (random weights, V3 tokenizer) checks real generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from chat_output_util import MODEL, ScriptedServer, calls_section, read_stream, scripted_server
from engine_util import make_engine
from openai_api_util import CHAT, MAX_MODEL_LEN, Served, serve, wait_idle

from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.tokenizer.files import write_tokenizer_files
from dsv3serve.tokenizer.locate import tokenizer_dir
from dsv3serve.tokenizer.tokenizer import Tokenizer

THOUGHT = "The user asks 2+2.\n2 + 2 = 4 🙂\n"
ANSWER = "\n\n2 + 2 = **4**"
R1_OUTPUT = THOUGHT + "</think>" + ANSWER
ASK = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def r1_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("r1_tokenizer")
    write_tokenizer_files(path, variant="deepseek-r1")
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module", params=[1, 4], ids=["1-token-chunks", "4-token-chunks"])
def r1(request: pytest.FixtureRequest, r1_tokenizer: Tokenizer) -> Iterator[ScriptedServer]:
    yield from scripted_server(
        r1_tokenizer, tokens_per_chunk=request.param, reasoning_parser="deepseek-r1"
    )


@pytest.fixture(scope="module")
def v3_parser() -> Iterator[ScriptedServer]:
    tokenizer = Tokenizer.from_dir(tokenizer_dir("tiny"))
    yield from scripted_server(tokenizer, reasoning_parser="deepseek-v3")


def create(server: ScriptedServer, **kw: Any) -> Any:
    return server.client().chat.completions.create(**({"model": MODEL, "messages": ASK} | kw))


def reasoning_tokens(usage: Any) -> int:
    return usage.completion_tokens_details.reasoning_tokens


def r1_counts(tokenizer: Tokenizer, text: str) -> tuple[int, int]:
    """(completion tokens, reasoning tokens): everything through the one </think> token."""
    ids = tokenizer.encode(text, add_bos=False)
    return len(ids), ids.index(tokenizer.token_to_id("</think>")) + 1


# ---- R1 template, fake model -----------------------------------------------------------------
def test_r1_split_whole_and_streamed_with_counts(r1: ScriptedServer) -> None:
    r1.say(R1_OUTPUT)
    whole = create(r1)
    assert r1.last_prompt().endswith("<｜Assistant｜><think>\n")
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT
    assert message.content == ANSWER and whole.choices[0].finish_reason == "stop"
    completion, reasoning = r1_counts(r1.backend.tokenizer, R1_OUTPUT)
    assert whole.usage.completion_tokens == completion
    assert reasoning_tokens(whole.usage) == reasoning < completion
    stream = create(r1, stream=True, stream_options={"include_usage": True})
    (streamed,), usage = read_stream(stream)
    assert (streamed.reasoning, streamed.content) == (THOUGHT, ANSWER)
    assert usage.completion_tokens == completion and reasoning_tokens(usage) == reasoning


def test_r1_cut_off_while_reasoning(r1: ScriptedServer) -> None:
    r1.say(R1_OUTPUT)
    whole = create(r1, max_tokens=5)
    message = whole.choices[0].message
    assert message.content is None and THOUGHT.startswith(message.model_extra["reasoning_content"])
    assert whole.choices[0].finish_reason == "length"
    assert reasoning_tokens(whole.usage) == whole.usage.completion_tokens == 5


def test_separate_reasoning_false_keeps_the_raw_text(r1: ScriptedServer) -> None:
    r1.say(R1_OUTPUT)
    whole = create(r1, extra_body={"separate_reasoning": False})
    message = whole.choices[0].message
    assert message.content == R1_OUTPUT and "reasoning_content" not in message.model_extra
    assert whole.usage.completion_tokens_details is None


def test_include_reasoning_false_drops_it_but_counts_it(r1: ScriptedServer) -> None:
    r1.say(R1_OUTPUT)
    whole = create(r1, extra_body={"include_reasoning": False})
    message = whole.choices[0].message
    assert message.content == ANSWER and "reasoning_content" not in message.model_extra
    assert reasoning_tokens(whole.usage) == r1_counts(r1.backend.tokenizer, R1_OUTPUT)[1]
    (streamed,), _ = read_stream(create(r1, stream=True, extra_body={"include_reasoning": False}))
    assert (streamed.reasoning, streamed.content) == ("", ANSWER)


def test_r1_without_thinking_reads_reasoning_only_after_an_opening_tag(r1: ScriptedServer) -> None:
    no_think = {"chat_template_kwargs": {"thinking": False}}
    r1.say("plain answer")
    whole = create(r1, extra_body=no_think)
    assert not r1.last_prompt().endswith("<think>\n")
    assert whole.choices[0].message.content == "plain answer"
    assert whole.choices[0].message.model_extra["reasoning_content"] is None
    assert reasoning_tokens(whole.usage) == 0
    r1.say("<think>" + R1_OUTPUT)
    whole = create(r1, extra_body=no_think)
    assert whole.choices[0].message.model_extra["reasoning_content"] == THOUGHT
    assert (
        reasoning_tokens(whole.usage) == r1_counts(r1.backend.tokenizer, "<think>" + R1_OUTPUT)[1]
    )


def test_reasoning_then_tool_call(r1: ScriptedServer) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    text = THOUGHT + "</think>" + calls_section(("add", '{"a": 1}'))
    r1.say(text)
    whole = create(r1, tools=[tool])
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content is None
    assert message.tool_calls[0].function.arguments == '{"a": 1}'
    assert whole.choices[0].finish_reason == "tool_calls"
    (streamed,), _ = read_stream(create(r1, tools=[tool], stream=True))
    assert streamed.reasoning == THOUGHT and streamed.calls[0]["arguments"] == '{"a": 1}'


def test_n2_counts_every_choice(r1: ScriptedServer) -> None:
    outputs = [R1_OUTPUT, "short</think>done"]
    r1.backend.script = lambda req, index: outputs[index]
    whole = create(r1, n=2)
    assert [c.message.content for c in whole.choices] == [ANSWER, "done"]
    counts = [r1_counts(r1.backend.tokenizer, text) for text in outputs]
    assert whole.usage.completion_tokens == sum(c for c, _ in counts)
    assert reasoning_tokens(whole.usage) == sum(r for _, r in counts)


# ---- deepseek-v3 parser: only in thinking mode ---------------------------------------------
def test_v3_parser_splits_only_in_thinking_mode(v3_parser: ScriptedServer) -> None:
    v3_parser.say(R1_OUTPUT)
    plain = create(v3_parser).choices[0].message
    assert plain.content == R1_OUTPUT and "reasoning_content" not in plain.model_extra
    thinking = create(v3_parser, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert v3_parser.last_prompt().endswith("<｜Assistant｜><think>\n")
    message = thinking.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (THOUGHT, ANSWER)
    assert 0 < reasoning_tokens(thinking.usage) < thinking.usage.completion_tokens


# ---- real generation: the tiny engine in thinking mode ---------------------------------------
@pytest.fixture(scope="module")
def thinking_served() -> Iterator[Served]:
    yield from serve(lambda backend: backend, reasoning_parser="deepseek-r1")


def offline_text(prompt_ids: list[int], params: SamplingParams) -> str:
    engine: Engine = make_engine(max_model_len=MAX_MODEL_LEN)
    engine.add_request(Request("ref", params, prompt_ids=prompt_ids))
    texts: list[str] = []
    while engine.has_unfinished():
        texts += [out.text for out in engine.step()]
    return "".join(texts)


def test_real_generation_inside_think_is_all_reasoning(thinking_served: Served) -> None:
    client: openai.OpenAI = thinking_served.client()
    kw = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 12}
    kw |= {"extra_body": {"ignore_eos": True, "chat_template_kwargs": {"thinking": True}}}
    whole = client.chat.completions.create(**kw)
    prompt = thinking_served.engine.tokenizer.encode_chat(CHAT, thinking=True)
    expected = offline_text(
        prompt, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    )
    assert "</think>" not in expected  # random weights: the reasoning never closes
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == expected and message.content is None
    assert whole.usage.prompt_tokens == len(prompt)
    assert reasoning_tokens(whole.usage) == whole.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    )
    (streamed,), usage = read_stream(stream)
    assert (streamed.reasoning, streamed.content) == (expected, "")
    assert reasoning_tokens(usage) == 12
    wait_idle(thinking_served)
