"""The migration loop: when a stream moves, what the continuation asks for, the bound, and
how a stream that cannot move ends.

The reserve / prefill / decode of one try is a scripted fake (``FakeAttempts``): these
cases need a decode failure at an exact token, which a real replica cannot be made to
have. The real-Ray kill is ``test_serving_faults.py``; the seam against a real engine is
``test_seam.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from dsv3serve.metrics import Identity, Metrics
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.tokenizer.detokenizer import IncrementalDetokenizer
from dsv3serve.tokenizer.locate import tokenizer_dir
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.pd.migration import DecodeLost, Migrator
from workers.backend import BackendOverloaded, BackendUnavailable
from workers.protocol import GenerateRequest, TokenChunk

LOST = "decode replica failed: ActorDiedError"
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir("tiny"))


@pytest.fixture(scope="module")
def output(tokenizer: Tokenizer) -> list[int]:
    """The full output of the stream: characters split over tokens (token 5 ends inside
    𝔘, so the engine holds its text back)."""
    return tokenizer.encode("Waves 🌊 and 𝔘 deep.", add_bos=False)


@dataclass
class Step:
    """One try: stream ``tokens`` more output tokens, then fail with ``error`` (or end).
    ``ends``: whether the output's last token comes as the engine sends it, finished
    (False: the break loses that chunk, so the router never hears that the stream ended)."""

    tokens: int
    error: Exception | None = None
    ends: bool = True


@dataclass
class FakeAttempts:
    """Stands in for reserve + prefill + decode on Ray replicas: try ``k`` streams the
    next ``steps[k].tokens`` tokens of ``output`` (with the engine's text) and then raises
    ``steps[k].error``; records the request of every try."""

    tokenizer: Tokenizer
    output: list[int]
    steps: list[Step]
    requests: list[GenerateRequest] = field(default_factory=list)

    async def __call__(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        step = self.steps[len(self.requests)]
        self.requests.append(req)
        done = len(req.prompt_ids) - len(PROMPT)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)  # as the engine does
        for i, token in enumerate(self.output[done : done + step.tokens]):
            last = step.ends and done + i + 1 == len(self.output)
            yield TokenChunk(
                request_id=req.request_id,
                token_ids=[token],
                text=detok.add(token) + (detok.flush() if last else ""),
                finished=last,
                finish_reason="length" if last else None,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=i + 1,
            )
        if step.error is not None:
            raise step.error


def request(output: list[int], **params: object) -> GenerateRequest:
    sampling = SamplingParams(temperature=0, max_new_tokens=len(output), **params)
    return GenerateRequest(request_id="chatcmpl-1", prompt_ids=PROMPT, params=sampling)


def run(
    attempts: FakeAttempts, req: GenerateRequest, max_migrations: int = 1, decode_up: bool = True
) -> tuple[list[TokenChunk], Metrics]:
    metrics = Metrics(Identity("router", "router", "tiny"))

    async def wait_for_decode(timeout_s: float) -> bool:
        return decode_up

    migrator = Migrator(attempts, wait_for_decode, attempts.tokenizer, max_migrations, 5.0, metrics)

    async def collect() -> list[TokenChunk]:
        return [chunk async for chunk in migrator.stream(req)]

    return asyncio.run(collect()), metrics


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    full = {"role": "router", "replica": "router", "model": "tiny", **labels}
    return metrics.registry.get_sample_value(f"dsv3serve:{name}", full)


def test_a_lost_stream_resumes_after_the_tokens_it_streamed(
    tokenizer: Tokenizer, output: list[int]
) -> None:
    attempts = FakeAttempts(tokenizer, output, [Step(6, DecodeLost(LOST)), Step(len(output))])
    chunks, metrics = run(attempts, request(output, stop=["never"], min_new_tokens=8))
    assert [t for c in chunks for t in c.token_ids] == output
    assert "".join(c.text for c in chunks) == tokenizer.decode(output)
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == len(output)
    assert {c.request_id for c in chunks} == {"chatcmpl-1"}
    assert {c.prompt_tokens for c in chunks} == {len(PROMPT)}
    resumed = attempts.requests[1]
    assert resumed.request_id == "chatcmpl-1.m1"
    assert resumed.prompt_ids == PROMPT + output[:6]
    assert resumed.params.max_new_tokens == len(output) - 6
    assert (resumed.params.min_new_tokens, resumed.params.stop) == (2, [])
    assert sample(metrics, "decode_migrations_total") == 1
    assert sample(metrics, "decode_migration_seconds_count") == 1


def test_a_stream_lost_before_its_first_token_starts_again(
    tokenizer: Tokenizer, output: list[int]
) -> None:
    attempts = FakeAttempts(tokenizer, output, [Step(0, DecodeLost(LOST)), Step(len(output))])
    chunks, _ = run(attempts, request(output))
    assert "".join(c.text for c in chunks) == tokenizer.decode(output)
    assert attempts.requests[1].prompt_ids == PROMPT


def test_migrations_are_bounded(tokenizer: Tokenizer, output: list[int]) -> None:
    steps = [Step(2, DecodeLost(LOST)), Step(2, DecodeLost(LOST)), Step(len(output))]
    chunks, metrics = run(FakeAttempts(tokenizer, output, steps), request(output), 1)
    end = chunks[-1]
    assert (end.finished, end.finish_reason, end.error_status) == (True, "error", 503)
    assert LOST in (end.error or "") and "max_decode_migrations (1)" in (end.error or "")
    assert [t for c in chunks for t in c.token_ids] == output[:4]
    assert sample(metrics, "decode_migration_failures_total", reason="exhausted") == 1


def test_without_migrations_a_loss_before_any_token_is_a_503(
    tokenizer: Tokenizer, output: list[int]
) -> None:
    attempts = FakeAttempts(tokenizer, output, [Step(0, DecodeLost(LOST))])
    with pytest.raises(BackendUnavailable, match="ActorDiedError"):
        run(attempts, request(output), max_migrations=0)


def test_a_stream_with_a_penalty_is_not_migrated(tokenizer: Tokenizer, output: list[int]) -> None:
    attempts = FakeAttempts(tokenizer, output, [Step(3, DecodeLost(LOST)), Step(len(output))])
    chunks, metrics = run(attempts, request(output, presence_penalty=0.5))
    assert "penalties" in (chunks[-1].error or "") and len(attempts.requests) == 1
    assert sample(metrics, "decode_migration_failures_total", reason="unsupported") == 1


def test_no_decode_replica_back_in_time_ends_the_stream(
    tokenizer: Tokenizer, output: list[int]
) -> None:
    attempts = FakeAttempts(tokenizer, output, [Step(3, DecodeLost(LOST)), Step(len(output))])
    chunks, metrics = run(attempts, request(output), decode_up=False)
    assert "decode_migration_wait_s (5 s)" in (chunks[-1].error or "")
    assert len(attempts.requests) == 1
    assert sample(metrics, "decode_migration_failures_total", reason="no_decode") == 1


def test_a_continuation_refused_after_tokens_ends_in_band(
    tokenizer: Tokenizer, output: list[int]
) -> None:
    full = BackendOverloaded("no decode replica has KV cache room; retry later")
    attempts = FakeAttempts(tokenizer, output, [Step(3, DecodeLost(LOST)), Step(0, full)])
    chunks, metrics = run(attempts, request(output))
    assert (chunks[-1].error_status, chunks[-1].error) == (429, full.message)
    assert sample(metrics, "decode_migration_failures_total", reason="failed") == 1


@pytest.mark.parametrize("stop_token", [False, True])
def test_a_loss_after_the_last_allowed_token_ends_the_stream(
    tokenizer: Tokenizer, output: list[int], stop_token: bool
) -> None:
    """The seventh token ends inside 𝔘 (its text is held back), and it is the last of
    ``max_tokens`` (or a stop token): the stream ends as the engine would have ended it,
    with the held-back text (none after a stop token), and is not migrated."""
    seven = output[:7]
    stop_ids = [seven[-1]] if stop_token else []
    attempts = FakeAttempts(tokenizer, seven, [Step(7, DecodeLost(LOST), ends=False)])
    chunks, metrics = run(attempts, request(seven, stop_token_ids=stop_ids))
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    want = "".join(detok.add(t) for t in seven[: 6 if stop_token else 7]) + detok.flush()
    assert "".join(c.text for c in chunks) == want
    assert [t for c in chunks for t in c.token_ids] == seven
    end = chunks[-1]
    assert (end.finished, end.error, end.completion_tokens) == (True, None, 7)
    assert end.finish_reason == ("stop" if stop_token else "length")
    assert len(attempts.requests) == 1 and sample(metrics, "decode_migrations_total") == 0
