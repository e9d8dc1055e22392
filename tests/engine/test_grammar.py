"""Structured output and logit_bias in the engine: the grammar compiler and matcher, the
sampler's mask and bias, and constrained generation on the plain, overlap and speculative
loops of the tiny model."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar
from engine_util import make_engine
from schema_cases import SCHEMAS, valid

from dsv3serve.engine.engine import Engine
from dsv3serve.engine.grammar import GrammarCompiler, full_bitmask
from dsv3serve.engine.intake import InvalidRequestError
from dsv3serve.engine.request import Request
from dsv3serve.engine.sampler import Sampler, SamplingBatch
from dsv3serve.model.tiny import cached_tiny_checkpoint
from dsv3serve.sampling.constraint import Constraint
from dsv3serve.sampling.sampling_params import SamplingParams, SamplingParamsError
from dsv3serve.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 129280
PROMPT = [5, 6, 7, 8]
LOOPS = {
    "plain": {},
    "overlap": {"force_overlap_schedule": True},
    "spec": {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2},
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(cached_tiny_checkpoint())


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


def generate_all(
    engine: Engine, requests: list[SamplingParams]
) -> list[list[tuple[str, str | None]]]:
    """Run ``requests`` together; per request, (text, finish reason) of each sequence."""
    for i, params in enumerate(requests):
        engine.add_request(Request(str(i), params, prompt_ids=PROMPT))
    texts: dict[tuple[int, int], list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            entry = texts.setdefault((int(out.request_id), out.index), ["", None])
            entry[0] += out.text
            entry[1] = out.finish_reason if out.finished else entry[1]
    return [[tuple(texts[i, j]) for j in range(p.n)] for i, p in enumerate(requests)]


def generate(engine: Engine, params: SamplingParams) -> list[tuple[str, str | None]]:
    """(text, finish reason) of each of the ``n`` sequences of one request."""
    return generate_all(engine, [params])[0]


# ---- compiler and matcher ------------------------------------------------------------
def test_compiled_grammars_are_cached_by_text(compiler: GrammarCompiler) -> None:
    first = compiler.compile(Constraint(kind="regex", text="[ab]{3}"))
    again = compiler.compile(Constraint(kind="regex", text="[ab]{3}"))
    other = compiler.compile(Constraint(kind="regex", text="[ab]{4}"))
    assert first is again and other is not first
    assert compiler.num_cached == 2


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint(kind="json_schema", text='{"type": "objectx"}'), 'Unsupported type "objectx"'),
        (Constraint(kind="regex", text="a(b"), "parenthesis is not closed"),
        (Constraint(kind="ebnf", text="root ::= foo"), 'Rule "foo" is not defined'),
    ],
)
def test_invalid_constraints_say_what_is_wrong(
    compiler: GrammarCompiler, constraint: Constraint, says: str
) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
        compiler.compile(constraint)
    assert str(info.value).startswith(f"invalid {constraint.kind}: ")
    assert ".cc:" not in str(info.value)  # no C++ source locations for the client


def test_draft_masks_follow_the_drafts_and_roll_back(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    state = compiler.new_state(Constraint(kind="regex", text="abc"))
    a, b, c = (tokenizer.token_to_id(ch) for ch in "abc")
    before = full_bitmask(1, VOCAB)
    state.fill(before, 0)
    kept, rows = state.draft_masks([a, b, a])  # the third is not allowed after "ab"
    assert kept == [a, b] and rows.shape[0] == 3
    assert torch.equal(rows[0], before[0])  # the first position: the current state
    for row, allowed in zip(rows, (a, b, c), strict=True):
        assert (int(row[allowed // 32]) >> (allowed % 32)) & 1
    kept, rows = state.draft_masks([a, b, c, tokenizer.eos_token_id])
    assert kept == [a, b, c] and rows.shape[0] == 4  # the end is left to the target
    after = full_bitmask(1, VOCAB)
    state.fill(after, 0)
    assert torch.equal(after, before)  # rolled back: nothing accepted


def test_sampler_mask_matches_xgrammar(compiler: GrammarCompiler) -> None:
    """Our device unpacking of the bitmask against xgrammar's own apply function."""
    state = compiler.new_state(Constraint(kind="json_object"))
    bitmask = full_bitmask(2, VOCAB)
    state.fill(bitmask, 1)  # row 0 stays unconstrained
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logprobs=0)] * 2
    batch = SamplingBatch.build(params, [None, None], [[1], [1]], [[], []], VOCAB, "cpu", bitmask)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, bitmask)
    assert torch.equal(batch.allowed, expected > -torch.inf)
    out = Sampler().sample(logits, batch)
    assert out.token_ids.tolist() == expected.argmax(-1).tolist()


# ---- logit_bias -----------------------------------------------------------------------
def test_logit_bias_moves_the_argmax_and_logprobs() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    best, second = logits[0].topk(2).indices.tolist()
    params = [
        SamplingParams(temperature=0, logprobs=0, logit_bias={best: -100}),
        SamplingParams(temperature=0, logprobs=0, logit_bias={7: 100}),
    ]
    batch = SamplingBatch.build(params, [None, None], [[1], [1]], [[], []], VOCAB, "cpu")
    out = Sampler().sample(logits, batch)
    assert out.token_ids.tolist() == [second, 7]
    assert out.logprobs[1] > -1e-3  # +100 takes (almost) all the mass


def test_logit_bias_is_range_checked() -> None:
    with pytest.raises(SamplingParamsError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={3: 100.5})
    engine = make_engine()
    params = SamplingParams(logit_bias={VOCAB: 1.0})
    with pytest.raises(InvalidRequestError, match=re.escape(f"must be in [0, {VOCAB})")):
        engine.add_request(Request("r", params, prompt_ids=PROMPT))
    assert engine.num_live_sequences == 0


# ---- generation -------------------------------------------------------------------------
@pytest.mark.parametrize("loop", list(LOOPS))
def test_constrained_outputs_validate_on_every_loop(loop: str) -> None:
    engine = make_engine(**LOOPS[loop])
    assert engine.overlap == (loop == "overlap") and (engine.spec is not None) == (loop == "spec")
    schemas = (SCHEMAS[9], SCHEMAS[12], SCHEMAS[19])
    requests = [
        SamplingParams(
            n=3, temperature=1.0, seed=3, max_new_tokens=120, constraint=Constraint.json_schema(s)
        )
        for s in schemas
    ]
    free = SamplingParams(n=3, temperature=1.0, max_new_tokens=30)
    *constrained, unconstrained = generate_all(engine, [*requests, free])
    for schema, outs in zip(schemas, constrained, strict=True):
        assert all(reason == "stop" and valid(text, schema) for text, reason in outs), outs
    assert not any(valid(text, SCHEMAS[9]) for text, _ in unconstrained)
    kv = engine.scheduler.kv
    kv.evict_all()
    assert engine.num_live_sequences == 0 and kv.free_pages == kv.num_pages


def test_regex_and_ebnf_outputs_match() -> None:
    engine = make_engine()
    regex = Constraint(kind="regex", text="(yes|no)-[0-9]{2}")
    for text, _ in generate(engine, SamplingParams(n=4, temperature=1.0, constraint=regex)):
        assert re.fullmatch(regex.text, text), text
    ebnf = Constraint(kind="ebnf", text='root ::= ("cat" | "dog") " " [0-9] [0-9]')
    for text, _ in generate(engine, SamplingParams(n=4, temperature=1.0, constraint=ebnf)):
        assert re.fullmatch("(cat|dog) [0-9]{2}", text), text


def test_invalid_constraint_is_refused_before_any_work() -> None:
    engine = make_engine()
    bad = Constraint(kind="json_schema", text=json.dumps({"type": "integer", "minimum": "x"}))
    with pytest.raises(InvalidRequestError, match="invalid json_schema"):
        engine.add_request(Request("r", SamplingParams(constraint=bad), prompt_ids=PROMPT))
    assert engine.num_live_sequences == 0 and not engine.has_unfinished()


def test_structural_tag_wraps_a_schema_in_tags() -> None:
    """The constraint kind tool calling targets: JSON arguments between begin/end tags."""
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    tag = {"type": "tag", "begin": "<tool>", "content": content, "end": "</tool>"}
    text = json.dumps({"type": "structural_tag", "format": tag})
    params = SamplingParams(
        n=3, temperature=1.0, constraint=Constraint(kind="structural_tag", text=text)
    )
    for out, reason in generate(make_engine(), params):
        inner = re.fullmatch(r"<tool>(.*)</tool>", out, re.DOTALL)
        assert reason == "stop" and inner and valid(inner.group(1), schema), out
