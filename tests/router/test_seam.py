"""The seam of a migrated stream, against a real engine's own streamed output.

The tiny model's greedy stream (real DeepSeek tokenizer: its output has tokens that end
inside a UTF-8 character, so the engine holds text back) is cut after every token; the
text the client saw up to the cut plus the seam's text of the rest must equal the
engine's unbroken stream, with a stop string that spans tokens (and, at some cuts, the
seam) found where the engine found it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pytest
from serving_util import TINY_ENGINE

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.request import Request
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.pd.seam import Seam, continuation, unsupported
from workers.convert import chunk_from_output
from workers.protocol import GenerateRequest, TokenChunk

MAX_TOKENS = 40
MESSAGES = [{"role": "user", "content": "Tell me about the sea, in detail."}]


@dataclass(frozen=True)
class Case:
    """The engine's unbroken streams of one prompt: without and with a stop string."""

    free: list[TokenChunk]  # no stop string: MAX_TOKENS tokens, "length"
    stopped: list[TokenChunk]  # the same, ended by ``stop``
    stop: str
    request: GenerateRequest  # the stopped one's request
    tokenizer: Tokenizer


def run(engine: Engine, req: GenerateRequest) -> list[TokenChunk]:
    engine.add_request(Request(req.request_id, req.params, prompt_ids=list(req.prompt_ids)))
    chunks: list[TokenChunk] = []
    while engine.has_unfinished():
        chunks += [chunk_from_output(out) for out in engine.step()]
    return chunks


def greedy(prompt: list[int], rid: str, stop: list[str]) -> GenerateRequest:
    params = SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS, ignore_eos=True, stop=stop)
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=params)


def tokens(chunks: Iterable[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def text(chunks: Iterable[TokenChunk]) -> str:
    return "".join(c.text for c in chunks)


def stop_across_tokens(chunks: list[TokenChunk]) -> str:
    """Eight characters of the text that start three before token 20's text: a stop string
    split over tokens, found only there."""
    full, start = text(chunks), len(text(chunks[:20])) - 3
    stop = full[start : start + 8]
    assert full.find(stop) == start, f"pick another stop string than {stop!r}"
    return stop


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(**TINY_ENGINE))


@pytest.fixture(scope="module")
def case(engine: Engine) -> Case:
    prompt = engine.tokenizer.encode_chat(MESSAGES, True)
    free = run(engine, greedy(prompt, "free", []))
    assert all(len(c.token_ids) == 1 for c in free)  # one chunk per token: cut anywhere
    assert any(c.text == "" for c in free[:-1]), "expected text held back at some token"
    stop = stop_across_tokens(free)
    request = greedy(prompt, "stopped", [stop])
    stopped = run(engine, request)
    assert stopped[-1].finish_reason == "stop" and stop not in text(stopped)
    return Case(free, stopped, stop, request, engine.tokenizer)


def fake_continuation_chunks(case: Case, cut: int) -> list[TokenChunk]:
    """What a continuation after ``cut`` tokens streams: the free run's tokens (the greedy
    continuation has no stop string), with text that is not the router's to trust."""
    rest = tokens(case.free)[cut:]
    return [
        TokenChunk(
            request_id=f"stopped.m1.{cut}",
            token_ids=[token],
            text="<not used>",
            finished=i == len(rest) - 1,
            finish_reason="length" if i == len(rest) - 1 else None,
            prompt_tokens=len(case.request.prompt_ids) + cut,
            completion_tokens=i + 1,
            cached_tokens=len(case.request.prompt_ids),
        )
        for i, token in enumerate(rest)
    ]


def through_seam(case: Case, cut: int, chunks: list[TokenChunk]) -> list[TokenChunk]:
    """The client's stream: the engine's chunks before ``cut``, then ``chunks`` rewritten
    up to the first finished one."""
    seen = case.stopped[:cut]
    usage = (seen[0].prompt_tokens, seen[0].cached_tokens) if seen else None
    seam = Seam(case.tokenizer, case.request, tokens(seen), usage)
    out = list(seen)
    for chunk in chunks:
        out.append(seam.rewrite(chunk))
        if out[-1].finished:
            break
    return out


def assert_same_stream(got: list[TokenChunk], want: list[TokenChunk]) -> None:
    assert text(got) == text(want)
    assert tokens(got) == tokens(want)
    assert (got[-1].finished, got[-1].finish_reason) == (True, want[-1].finish_reason)
    assert got[-1].completion_tokens == want[-1].completion_tokens
    assert {c.prompt_tokens for c in got} == {want[0].prompt_tokens}
    assert {c.request_id for c in got} == {want[0].request_id}


def test_every_cut_gives_the_unbroken_text_and_stop(case: Case) -> None:
    for cut in range(len(case.stopped)):
        got = through_seam(case, cut, fake_continuation_chunks(case, cut))
        assert_same_stream(got, case.stopped)


def test_real_continuations_join_the_stream(engine: Engine, case: Case) -> None:
    """The continuation request itself on the engine: prompt + tokens so far, the budget
    left, no stop string; cut where text was held back and inside the stop string."""
    held = next(i + 1 for i, c in enumerate(case.free) if c.text == "")
    inside_stop = 20  # the stop string starts three characters before token 20's text
    for cut in (held, inside_stop):
        resumed = continuation(case.request, tokens(case.stopped[:cut]), 1)
        assert resumed.params.stop == [] and resumed.request_id == "stopped.m1"
        assert resumed.params.max_new_tokens == MAX_TOKENS - cut
        got = through_seam(case, cut, run(engine, resumed))
        assert_same_stream(got, case.stopped)


def test_a_continuation_ends_by_length_where_the_stream_would(engine: Engine, case: Case) -> None:
    free_request = case.request.model_copy(
        update={"params": case.request.params.model_copy(update={"stop": []})}
    )
    cut = MAX_TOKENS - 3
    seen = case.free[:cut]
    seam = Seam(case.tokenizer, free_request, tokens(seen), (seen[0].prompt_tokens, 0))
    rest = [seam.rewrite(c) for c in run(engine, continuation(free_request, tokens(seen), 2))]
    got = [*seen, *rest]
    assert text(got) == text(case.free) and tokens(got) == tokens(case.free)
    assert got[-1].finish_reason == "length"
    assert got[-1].completion_tokens == MAX_TOKENS
    assert {c.cached_tokens for c in rest} == {0}  # the original's, not the re-prefill's


def test_a_continuation_needs_tokens_left(case: Case) -> None:
    with pytest.raises(ValueError, match="no tokens left"):
        continuation(case.request, tokens(case.free), 1)


def test_state_a_continuation_cannot_rebuild_is_named() -> None:
    assert unsupported(SamplingParams(temperature=0.7, seed=3)) is None
    assert "penalties" in (unsupported(SamplingParams(presence_penalty=0.5)) or "")
    assert "penalties" in (unsupported(SamplingParams(frequency_penalty=-0.5)) or "")
    json_object = SamplingParams(constraint={"kind": "json_object"})
    assert "structured-output" in (unsupported(json_object) or "")
