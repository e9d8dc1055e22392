"""Speculative decoding with the NextN draft in the engine (tiny FP8 model, CPU).

Lossless greedy: outputs with speculation equal those without it, token for token, with
the checkpoint's (random) NextN draft and with a target oracle draft that is partly
wrong (so rounds accept some drafts and roll back the rest), across chunked prefill, the
prefix cache, preemption and abort; every page comes back. Accept length: 4 (num_steps
+ 1) when the draft is the target, about 1 with the random NextN draft. Lossless
sampling: see ``test_sampled_outputs_keep_the_target_distribution``.
"""

from __future__ import annotations

import asyncio
import collections

import pytest
import torch
from engine_util import drain, make_engine, prompts
from scipy.stats import chi2_contingency
from spec_util import TargetOracleDraft, scratch_drafts

from dsv3serve.cli import build_parser
from dsv3serve.engine.async_engine import AsyncEngine
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine, KVExport
from dsv3serve.engine.request import Request
from dsv3serve.engine.speculative.stats import SpecStats
from dsv3serve.metrics import Identity, Metrics
from dsv3serve.model.tiny import make_tiny_checkpoint
from dsv3serve.sampling.sampling_params import SamplingParams

STEPS = 3
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": STEPS}
GREEDY = SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True)  # 1 + 2 rounds of 4
MIXED = prompts(8, seed=21)
SHARED = prompts(1, seed=22, lo=22, hi=22)[0]
PREFIXED = [SHARED + tail for tail in prompts(4, seed=23, lo=1, hi=5)]


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    """Every prompt's greedy output without speculation (one batched run)."""
    engine = make_engine(enable_prefix_caching=False)
    all_prompts = MIXED + PREFIXED
    for i, ids in enumerate(all_prompts):
        engine.add_request(Request(f"r{i}", GREEDY, prompt_ids=ids))
    got = drain(engine)
    return {tuple(ids): got[f"r{i}"] for i, ids in enumerate(all_prompts)}


@pytest.fixture(scope="module")
def spec_engine() -> Engine:
    return make_engine(**SPEC)


@pytest.fixture
def fresh(spec_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """The shared speculative engine with zeroed stats and its own NextN draft."""
    monkeypatch.setattr(spec_engine, "spec_stats", SpecStats(STEPS))
    monkeypatch.setattr(spec_engine.spec, "propose", spec_engine.spec.propose)
    return spec_engine


def run(engine: Engine, batch: list[list[int]], params: SamplingParams = GREEDY) -> dict:
    """Half the prompts first, the rest a few steps later; outputs by prompt."""
    half = len(batch) // 2
    results: dict[str, list[int]] = {}
    for i, ids in enumerate(batch):
        if i == half:
            for _ in range(3):
                for out in engine.step():
                    results.setdefault(out.request_id, []).extend(out.token_ids)
        engine.add_request(Request(f"q{i}", params, prompt_ids=ids))
    drain(engine, results)
    return {tuple(ids): results[f"q{i}"] for i, ids in enumerate(batch)}


def assert_no_leaks(engine: Engine) -> None:
    kv = engine.scheduler.kv
    assert kv.used_pages == 0
    kv.evict_all()
    assert kv.free_pages == kv.num_pages
    engine.scheduler.check_invariants()


def test_greedy_with_the_nextn_draft_is_lossless(fresh, reference) -> None:
    assert run(fresh, MIXED) == {tuple(p): reference[tuple(p)] for p in MIXED}
    stats = fresh.spec_stats  # one token per round: 8 rounds, the last without drafts
    assert stats.rounds == 7 * len(MIXED)
    assert stats.drafted_at == [7 * len(MIXED), 6 * len(MIXED), 5 * len(MIXED)]
    assert stats.mean_accept_length < 1.2  # the tiny checkpoint's NextN layer is random
    assert_no_leaks(fresh)


def test_target_oracle_draft_is_accepted_in_full(fresh, reference) -> None:
    fresh.spec.propose = TargetOracleDraft(fresh).propose
    assert run(fresh, MIXED) == {tuple(p): reference[tuple(p)] for p in MIXED}
    stats = fresh.spec_stats
    assert stats.rounds == 2 * len(MIXED)
    assert stats.mean_accept_length == STEPS + 1
    assert stats.acceptance_by_position == [1.0] * STEPS
    assert_no_leaks(fresh)


def test_nextn_chain_equals_the_draft_recomputed_from_scratch(fresh) -> None:
    """The draft KV the engine keeps (written in pieces, rolled back, shared through the
    prefix cache) gives the same drafts as the draft run over the whole sequence."""
    proposed: list[tuple[list[int], list[int]]] = []
    chain = fresh.spec.propose

    def recording(items):
        drafts = chain(items)
        for item in items:
            if item.seq_id in drafts:
                proposed.append((item.seq.all_token_ids, drafts[item.seq_id]))
        return drafts

    fresh.spec.propose = recording
    hits = fresh.scheduler.prefix_hit_tokens
    run(fresh, MIXED[:2])
    run(fresh, PREFIXED[:1])
    run(fresh, PREFIXED[1:3])  # their shared prefix comes from the cache
    assert fresh.scheduler.prefix_hit_tokens - hits >= 2 * 20
    assert len(proposed) == 7 * 5  # one token per round with the random NextN draft
    for context, drafts in proposed:
        assert drafts == scratch_drafts(fresh.runner.model, context, len(drafts))


@pytest.mark.parametrize(
    "scenario",
    ["chunked", "prefix_cache", "preemption"],
)
def test_greedy_with_a_partly_wrong_draft_is_lossless(scenario, reference) -> None:
    config, batch = {
        "chunked": ({"chunked_prefill_size": 4, "max_num_batched_tokens": 16}, MIXED),
        "prefix_cache": ({}, PREFIXED + PREFIXED[:2]),
        "preemption": ({"num_kv_tokens": 96, "enable_prefix_caching": False}, MIXED),
    }[scenario]
    engine = make_engine(**SPEC, **config)
    engine.spec.propose = TargetOracleDraft(engine, wrong=0.3, seed=1).propose
    if scenario == "prefix_cache":
        assert run(engine, PREFIXED[:1]) == {tuple(PREFIXED[0]): reference[tuple(PREFIXED[0])]}
    assert run(engine, batch) == {tuple(p): reference[tuple(p)] for p in batch}
    stats = engine.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    if scenario == "prefix_cache":
        assert engine.scheduler.prefix_hit_tokens >= 5 * 20
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_abort_mid_decode_frees_everything(fresh, reference) -> None:
    fresh.spec.propose = TargetOracleDraft(fresh, wrong=0.3, seed=2).propose
    for i, ids in enumerate(MIXED[:4]):
        fresh.add_request(Request(f"a{i}", GREEDY, prompt_ids=ids))
    results: dict[str, list[int]] = {}
    for _ in range(3):
        for out in fresh.step():
            results.setdefault(out.request_id, []).extend(out.token_ids)
    assert fresh.spec_stats.rounds > 0
    assert fresh.abort("a1")
    drain(fresh, results)
    assert 0 < len(results["a1"]) < GREEDY.max_new_tokens
    for i in (0, 2, 3):
        assert results[f"a{i}"] == reference[tuple(MIXED[i])]
    assert_no_leaks(fresh)


def sample_outcomes(engine: Engine, n: int, seed: int) -> collections.Counter:
    """Counts of the first 4 output tokens of ``n`` seeded samples of one prompt."""
    params = SamplingParams(
        temperature=1.0, top_k=2, max_new_tokens=4, ignore_eos=True, seed=seed, n=n
    )
    engine.add_request(Request("s", params, prompt_ids=[5, 6, 7]))
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.index, []).extend(out.token_ids)
    return collections.Counter(tuple(tokens) for tokens in outputs.values())


def test_sampled_outputs_keep_the_target_distribution(tmp_path_factory) -> None:
    """Two-sample chi-square test of homogeneity on the joint of the first 4 tokens.

    Temperature 1 over the top 2 tokens of a 512-token vocabulary (the tiny checkpoint
    with ``vocab_size`` 512, so one sample is cheap) gives at most 16 outcomes, each
    likely enough to count. Speculation uses the target oracle draft, whose drafts the
    target accepts with probability max(p) >= 1/2, so accepts and rejects both occur.
    N = 1000 independent samples per arm (different seeds); outcomes seen fewer than 10
    times in total are pooled. The test rejects at alpha = 1e-4: with fresh seeds a
    correct implementation fails once in 10,000 runs (with the seeds here, never). It
    has power: drawing the correction from p instead of norm(max(p - q, 0)) gives a
    p-value of 1e-40 here.
    """
    model = make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_v512"), overrides={"vocab_size": 512}
    )
    n, args = 1000, {"model": str(model), "max_running_requests": 1000, "num_kv_tokens": 16384}
    plain = sample_outcomes(make_engine(**args), n, seed=1)
    engine = make_engine(**args, **SPEC)
    engine.spec.propose = TargetOracleDraft(engine).propose
    spec = sample_outcomes(engine, n, seed=1 + n)
    stats = engine.spec_stats
    assert stats.rounds >= n and 0 < stats.accepted_tokens < stats.draft_tokens
    outcomes = sorted(set(plain) | set(spec), key=lambda o: -(plain[o] + spec[o]))
    common = [o for o in outcomes if plain[o] + spec[o] >= 10]
    table = [
        [counts[o] for o in common] + [n - sum(counts[o] for o in common)]
        for counts in (plain, spec)
    ]
    if table[0][-1] + table[1][-1] == 0:  # no rare outcomes to pool
        table = [row[:-1] for row in table]
    assert len(common) >= 8
    assert chi2_contingency(table).pvalue > 1e-4


def test_pd_handoff_carries_the_draft_state(fresh, reference) -> None:
    """Prefill-only export, then import (on the same engine, as another request, through
    AsyncEngine): the first decode step drafts at once, as a colocated sequence would."""
    ids, aeng = MIXED[3], AsyncEngine(fresh)
    chain, proposed = fresh.spec.propose, []
    fresh.spec.propose = lambda items: proposed.append(chain(items)) or proposed[-1]

    async def prefill_then_decode() -> tuple[list[int], KVExport | None, list[int]]:
        first, export = await aeng.prefill(Request("pre", GREEDY, prompt_ids=ids))
        assert export is not None
        pages = aeng.call(lambda e: e.reserve_kv(len(ids)))
        kv = aeng.call(lambda e: e.runner.read_pages(export.pages))
        aeng.call(lambda e: e.runner.write_pages(pages[: len(export.pages)], kv))
        aeng.call(lambda e: e.release_export("pre"))
        req = Request("dec", GREEDY, prompt_ids=ids)
        stream = aeng.generate_imported(req, export.first_token, pages, draft=export.draft)
        return first.token_ids, export, [t async for out in stream for t in out.token_ids]

    first, export, streamed = asyncio.run(prefill_then_decode())
    assert export is not None and export.draft is not None
    assert export.draft.num_tokens == len(ids) + 1
    assert first + streamed[1:] == streamed == reference[tuple(ids)]
    first_round = next(p for p in proposed if "dec#0" in p)["dec#0"]
    assert first_round == scratch_drafts(fresh.runner.model, ids + first, STEPS)
    assert_no_leaks(fresh)


def test_metrics_count_rounds_drafts_and_accepts(fresh) -> None:
    fresh.metrics = metrics = Metrics(Identity("colocated", "0", "tiny"))
    fresh.spec.propose = TargetOracleDraft(fresh, wrong=0.3, seed=3).propose
    try:
        run(fresh, MIXED[:3])
    finally:
        fresh.metrics = None
    stats, labels = fresh.spec_stats, metrics.identity.labels()

    def value(name: str, **extra: str) -> float:
        return metrics.registry.get_sample_value(f"dsv3serve:{name}", labels | extra) or 0.0

    assert value("spec_decode_num_drafts_total") == stats.rounds > 0
    assert value("spec_decode_num_draft_tokens_total") == stats.draft_tokens
    assert value("spec_decode_num_accepted_tokens_total") == stats.accepted_tokens > 0
    per_position = [
        value("spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
        for j in range(STEPS)
    ]
    assert per_position == stats.accepted_at
    assert value("spec_decode_accept_length_count") == stats.rounds
    assert value("spec_decode_accept_length_sum") == stats.accepted_tokens + stats.rounds


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"speculative_eagle_topk": 4}, "speculative_eagle_topk: found 4, expected 1"),
        ({"speculative_num_draft_tokens": 5}, "speculative_num_draft_tokens: found 5"),
        ({"speculative_algorithm": None}, "speculative_num_steps: set speculative_algorithm"),
        ({"speculative_algorithm": "MEDUSA"}, "speculative_algorithm"),
    ],
)
def test_bad_speculative_options_are_rejected_naming_the_field(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**({"model": "tiny"} | SPEC | fields))


def test_cli_flags_reach_the_engine_config() -> None:
    args = build_parser().parse_args(
        ["generate", "--prompt", "hi", "--speculative-algorithm", "EAGLE"]
        + ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1"]
        + [
            "--speculative-num-draft-tokens",
            "3",
            "--speculative-draft-model-quantization",
            "unquant",
        ]
    )
    cfg = EngineConfig.from_args(args)
    assert (cfg.speculative_algorithm, cfg.spec_num_steps, cfg.speculative_num_draft_tokens) == (
        "EAGLE",
        2,
        3,
    )
    assert cfg.speculative_draft_model_quantization == "unquant"
    plain = build_parser().parse_args(["generate", "--prompt", "x"])
    assert EngineConfig.from_args(plain).spec_num_steps == 0


def test_unquantised_draft_is_still_lossless(reference) -> None:
    engine = make_engine(**SPEC, speculative_draft_model_quantization="unquant")
    assert not any(p.dtype == torch.float8_e4m3fn for p in engine.spec.draft.layer.parameters())
    assert any(p.dtype == torch.float8_e4m3fn for p in engine.runner.model.layers.parameters())
    assert run(engine, MIXED[:3]) == {tuple(p): reference[tuple(p)] for p in MIXED[:3]}
    assert_no_leaks(engine)


def collect(engine: Engine, batch: list[list[int]], params: SamplingParams) -> list[tuple]:
    """Per prompt: (tokens, logprobs, top-logprob ids, finish reason)."""
    for i, ids in enumerate(batch):
        engine.add_request(Request(f"c{i}", params, prompt_ids=ids))
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    results = []
    for i in range(len(batch)):
        chunks = outs[f"c{i}"]
        tokens = [t for c in chunks for t in c.token_ids]
        logprobs = [lp for c in chunks for lp in c.logprobs]
        tops = [sorted(top) for c in chunks for top in c.top_logprobs]
        results.append((tokens, logprobs, tops, chunks[-1].finish_reason))
    return results


def test_penalties_logprobs_and_stops_apply_per_verified_position(fresh) -> None:
    """Each position sees the drafts before it in its penalty history and min_new_tokens
    count; a stop token inside a round ends the request there; logprobs match."""
    fresh.spec.propose = TargetOracleDraft(fresh).propose  # knows nothing of penalties
    plain = make_engine()
    base = {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True, "logprobs": 2}
    base |= {"repetition_penalty": 0.3, "frequency_penalty": 0.4, "presence_penalty": -1.0}
    stop = collect(plain, MIXED[:1], SamplingParams(**base))[0][0][5]
    params = SamplingParams(**base, stop_token_ids=[stop], min_new_tokens=2)
    want, got = collect(plain, MIXED[:3], params), collect(fresh, MIXED[:3], params)
    assert want[0][3] == "stop" and len(want[0][0]) <= 6
    assert fresh.spec_stats.accepted_tokens > 0
    for (tokens, logprobs, tops, reason), (tokens2, logprobs2, tops2, reason2) in zip(
        want, got, strict=True
    ):
        assert (tokens2, tops2, reason2) == (tokens, tops, reason)
        assert logprobs2 == pytest.approx(logprobs, abs=1e-4)
    assert_no_leaks(fresh)
