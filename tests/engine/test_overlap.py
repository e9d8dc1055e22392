"""Overlap scheduler on CPU (forced on): the same outputs as without it, and no leaks.

Every scenario runs the same requests through an engine without overlap (the oracle) and
one with ``force_overlap_schedule``; greedy and seeded rows must give identical tokens,
text, finish reasons and (to float tolerance) logprobs, and every page must come back.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from functools import cache

import pytest
import torch
from engine_util import GREEDY, drain, make_engine, prompts

from dsv3serve.cli import build_parser
from dsv3serve.engine.async_engine import AsyncEngine
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.future_tokens import FutureTokens
from dsv3serve.engine.request import Request, TokenOutput
from dsv3serve.sampling.sampling_params import SamplingParams

CHUNKED = (("chunked_prefill_size", 8), ("max_num_batched_tokens", 16))
SMALL_KV = (("num_kv_tokens", 64), ("enable_prefix_caching", False))


@cache
def engine_pair(options: tuple[tuple[str, object], ...] = ()) -> tuple[Engine, Engine]:
    """(without overlap, with overlap) engines of one configuration, built once."""
    kw = dict(options)
    off, on = make_engine(**kw), make_engine(force_overlap_schedule=True, **kw)
    assert not off.overlap and on.overlap
    return off, on


@dataclass
class Stream:
    """Everything one sequence reported, concatenated."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)
    finish: str | None = None
    completion_tokens: int = 0

    def add(self, out: TokenOutput) -> None:
        assert self.finish is None, f"output after the finish of {out.request_id}"
        self.tokens += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs
        self.tops += out.top_logprobs
        self.finish = out.finish_reason if out.finished else None
        self.completion_tokens = out.completion_tokens


def run(
    engine: Engine,
    requests: list[Request],
    late: list[Request] = (),
    aborts: dict[int, list[str]] | None = None,
) -> dict[tuple[str, int], Stream]:
    """Add ``requests``, step (adding ``late`` after 3 steps, aborting per ``aborts``) to
    the end; checks the scheduler's invariants after every step."""
    for req in requests:
        engine.add_request(req)
    streams: dict[tuple[str, int], Stream] = {}
    step = 0
    placeholder_inputs = 0  # overlap: decode inputs the host did not know at launch
    while engine.has_unfinished():
        if step == 3:
            for req in late:
                engine.add_request(req)
        for rid in (aborts or {}).get(step, []):
            engine.abort(rid)
        for out in engine.step():
            streams.setdefault((out.request_id, out.index), Stream()).add(out)
        engine.scheduler.check_invariants()
        launched = engine._overlap.launched if engine._overlap is not None else None
        if launched is not None:
            placeholder_inputs += sum(t < 0 for i in launched.batch.items for t in i.token_ids)
        step += 1
        assert step < 2000, "engine did not finish"
    assert_no_leak(engine)
    assert (
        placeholder_inputs > 0
        or not engine.overlap
        or not any(s.tokens[1:] for s in streams.values())
    )
    return streams


def assert_no_leak(engine: Engine) -> None:
    kv = engine.scheduler.kv
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    kv.evict_all()
    assert kv.free_pages == kv.num_pages


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, w in want.items():
        g = got[key]
        assert (g.tokens, g.text, g.finish, g.completion_tokens) == (
            w.tokens,
            w.text,
            w.finish,
            w.completion_tokens,
        ), key
        assert len(g.tokens) == len(g.logprobs) or not w.logprobs
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4), key
        assert [sorted(t) for t in g.tops] == [sorted(t) for t in w.tops], key


def both(make, options=()) -> tuple[dict, dict]:
    """``run`` the requests of ``make()`` on the pair of ``options`` (fresh Requests each)."""
    off, on = engine_pair(options)
    want = run(off, *make())
    got = run(on, *make())
    return got, want


def mixed_requests(tag: str, count: int = 8, seed: int = 0, **params) -> list[Request]:
    """Greedy, seeded-sampling and logprob rows over prompts of 1 to 40 tokens."""
    kinds = [
        SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, **params),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=4, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=50, seed=3, n=2, max_new_tokens=4, logprobs=2),
    ]
    return [
        Request(f"{tag}{i}", kinds[i % len(kinds)], prompt_ids=p)
        for i, p in enumerate(prompts(count, seed=seed))
    ]


def test_mixed_batch_with_late_arrivals_matches_no_overlap() -> None:
    def make():
        return mixed_requests("a", 5, seed=1), mixed_requests("late", 3, seed=2)

    got, want = both(make)
    assert_same(got, want)


def test_chunked_prefill_and_prefix_cache_hits_match_no_overlap() -> None:
    shared = prompts(1, seed=5, lo=13, hi=13)[0]

    def make():
        first = [Request(f"p{i}", GREEDY, prompt_ids=shared + p) for i, p in enumerate(prompts(2))]
        late = [
            Request(f"q{i}", GREEDY, prompt_ids=shared + p)
            for i, p in enumerate(prompts(2, seed=9))
        ]
        return first + mixed_requests("c", 2, seed=4), late

    _, on = engine_pair(CHUNKED)
    hits = on.scheduler.prefix_hit_tokens
    got, want = both(make, CHUNKED)
    assert_same(got, want)
    assert on.scheduler.prefix_hit_tokens - hits >= 12  # later requests reused the prefix


def test_stop_tokens_strings_and_max_tokens_match_no_overlap() -> None:
    off, _ = engine_pair()
    ps = prompts(4, seed=12, lo=5, hi=25)
    long = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    refs = run(off, [Request(f"ref{i}", long, prompt_ids=p) for i, p in enumerate(ps)])
    full = [refs[(f"ref{i}", 0)].tokens for i in range(len(ps))]
    text = refs[("ref1", 0)].text
    stop_params = [
        SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=[full[0][3]]),
        SamplingParams(temperature=0, max_new_tokens=8, stop=[text[len(text) // 2 :][:3]]),
        SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True),
    ]

    def make():
        pairs = enumerate(zip(stop_params, ps, strict=True))
        return [Request(f"s{i}", sp, prompt_ids=p) for i, (sp, p) in pairs], []

    got, want = both(make)
    assert_same(got, want)
    assert got[("s0", 0)].tokens == full[0][:4] and got[("s0", 0)].finish == "stop"
    assert got[("s1", 0)].finish == "stop" and len(got[("s1", 0)].tokens) < 8
    assert [len(got[(f"s{i}", 0)].tokens) for i in (2, 3)] == [2, 1]


def test_preemption_under_a_tiny_pool_matches_no_overlap() -> None:
    _, on = engine_pair(SMALL_KV)
    before = on.scheduler.num_preemptions

    def make():
        return [Request(f"r{i}", GREEDY, prompt_ids=p) for i, p in enumerate(prompts(5, hi=25))], []

    got, want = both(make, SMALL_KV)
    assert_same(got, want)
    assert on.scheduler.num_preemptions > before


def test_penalties_match_no_overlap() -> None:
    pen = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2}

    def make():
        return mixed_requests("pen", 4, seed=8, **pen), []

    got, want = both(make)
    assert_same(got, want)


@pytest.mark.parametrize("abort_step", [1, 3])
def test_abort_mid_generation_frees_everything(abort_step: int) -> None:
    """Aborts land between steps while a step is in flight; the others are unaffected."""

    def make():
        return mixed_requests("ab", 4, seed=abort_step), []

    _, on = engine_pair()
    want = run(engine_pair()[0], *make())
    got = run(on, *make(), aborts={abort_step: ["ab0", "ab3"]})
    for key, stream in got.items():
        if key[0] in ("ab0", "ab3"):
            assert stream.finish == "abort"
            assert stream.tokens == want[key].tokens[: len(stream.tokens)]
            assert stream.completion_tokens == len(stream.tokens)
        else:
            assert_same({key: stream}, {key: want[key]})


def test_prefill_export_and_decode_import_with_overlap() -> None:
    off, on = engine_pair()
    decode = make_engine(force_overlap_schedule=True)
    for i, ids in enumerate(prompts(2, seed=31, lo=5, hi=30)):
        rid = f"pd{i}"
        want = run(off, [Request(rid, GREEDY, prompt_ids=ids)])[(rid, 0)].tokens
        pages = decode.reserve_kv(len(ids))
        on.add_request(Request(rid, GREEDY, prompt_ids=ids), prefill_only=True)
        first = drain(on)[rid]
        export = on.export_kv(rid)
        assert first == [export.first_token] == want[:1]
        decode.runner.write_pages(pages[: len(export.pages)], on.runner.read_pages(export.pages))
        on.release_export(rid)
        decode.import_kv(Request(rid, GREEDY, prompt_ids=ids), export.first_token, pages)
        assert drain(decode)[rid] == want
    for engine in (on, decode):
        assert_no_leak(engine)


def test_async_engine_streams_match_no_overlap() -> None:
    off, on = engine_pair()
    ps = prompts(3, seed=21)
    expected = [run(off, [Request("x", GREEDY, prompt_ids=p)])[("x", 0)].tokens for p in ps]
    aeng = AsyncEngine(on)

    async def collect(i: int) -> list[int]:
        got: list[int] = []
        async for out in aeng.generate(Request(f"s{i}", GREEDY, prompt_ids=ps[i])):
            got += out.token_ids
        return got

    async def leave_early() -> None:
        stream = aeng.generate(Request("early", GREEDY, prompt_ids=ps[0]))
        async for _ in stream:
            break
        await stream.aclose()

    async def main() -> list[list[int]]:
        results = await asyncio.gather(*(collect(i) for i in range(3)), leave_early())
        return list(results[:3])

    assert asyncio.run(main()) == expected
    drain(on)
    assert_no_leak(on)
    assert not on.has_unfinished()


# --- pieces ---------------------------------------------------------------------------


def test_future_tokens_resolve_placeholders_like_a_lookup_table() -> None:
    """Ring of 3 * 5 + 1 slots for steps of up to 5 rows: the last two steps' placeholders
    stay intact across the wrap."""
    rng = random.Random(0)
    future = FutureTokens(16, torch.device("cpu"))
    steps: list[dict[int, int]] = []
    for num in (4, 3, 5, 0, 2, 5):  # the last step wraps to slot 0
        start = future.reserve(num)
        tokens = [rng.randrange(0, 1000) for _ in range(num)]
        future.store(start, torch.tensor(tokens, dtype=torch.int64))
        steps.append(dict(zip(future.placeholders(start, num), tokens, strict=True)))
    assert min(steps[-1]) == -5  # wrapped: slots 0..4
    live = steps[-2] | steps[-1]
    ids = [rng.choice(list(live)) if rng.random() < 0.5 else rng.randrange(1000) for _ in range(50)]
    want = [live[i] if i < 0 else i for i in ids]
    assert future.resolve(torch.tensor(ids)).tolist() == want
    embed = torch.nn.Embedding(1000, 8)
    future.install(embed)
    torch.testing.assert_close(embed(torch.tensor(ids)), embed.weight[torch.tensor(want)])


def test_overlap_is_on_for_cuda_only_unless_forced_and_never_with_speculation() -> None:
    def cfg(**kw) -> EngineConfig:
        return EngineConfig(model="tiny", **kw)

    assert cfg(device="cuda").overlap_schedule and cfg(device="cuda:1").overlap_schedule
    assert not cfg(device="cuda", disable_overlap_schedule=True).overlap_schedule
    assert not cfg().overlap_schedule and cfg(force_overlap_schedule=True).overlap_schedule
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
    assert not cfg(device="cuda", **spec).overlap_schedule
    with pytest.raises(ValueError, match="expected at most one"):
        cfg(disable_overlap_schedule=True, force_overlap_schedule=True)
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--disable-overlap-schedule", "--enable-torch-compile"]
    )
    flags = EngineConfig.from_args(args, device="cuda")
    assert flags.disable_overlap_schedule and not flags.overlap_schedule
    assert flags.enable_torch_compile and flags.torch_compile_max_bs == 32
    plain = EngineConfig.from_args(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert not plain.disable_overlap_schedule and not plain.enable_torch_compile
