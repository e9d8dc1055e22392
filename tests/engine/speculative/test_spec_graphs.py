"""Speculative decoding's CUDA-graph paths on the CPU, capture off (the padding and
static buffers run eagerly): the padded verify and the padded draft chain (a graph per step) give
the eager path's logits and tokens and write only the scratch page besides the real
slots; the engine stays lossless (greedy) with them and the padded extend in use."""

from __future__ import annotations

import random

import pytest
import torch
from engine_util import drain, make_engine, prompts
from graph_fakes import RecordingFakeGraph

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.graph_capture import GraphSetup
from dsv3serve.engine.model_runner import EAGER_GRAPH_PATH_ENV, ModelRunner, kv_slots
from dsv3serve.engine.request import Request
from dsv3serve.engine.speculative.graphs import DraftChainGraphs, SpecGraphs, VerifyGraphs
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.sampling.sampling_params import SamplingParams

PAGE, STEPS = 4, 3
SPEC = {"speculative_algorithm": "NEXTN", "speculative_num_steps": STEPS}


@pytest.fixture(scope="module")
def engine(tiny_bf16_dir) -> Engine:
    cfg = EngineConfig(model=str(tiny_bf16_dir), num_kv_tokens=1024, page_size=PAGE, **SPEC)
    return Engine(cfg)


def _prefill(runner: ModelRunner, lens: list[int], rng: random.Random) -> list[list[int]]:
    """Prefill one sequence per length on pages of its own; returns the page tables
    (room for ``STEPS + 1`` more tokens)."""
    tables, first = [], 0
    for n in lens:
        table = list(range(first, first + (n + STEPS + 1) // PAGE + 1))
        first = table[-1] + 1
        ids = [rng.randrange(2, 1000) for _ in range(n)]
        runner.run_spans([SeqSpan(ids, 0, kv_slots(table, PAGE, n))], None)
        tables.append(table)
    return tables


def _changed(before: torch.Tensor, after: torch.Tensor) -> list[list[int]]:
    """[page, row] of every cache row that differs."""
    return sorted((after != before).any(-1).nonzero().tolist())


def _scratch(runner: ModelRunner) -> tuple[int, list[int]]:
    page = runner.pool.num_pages - 1  # no sequence of these tests reaches it
    return page, kv_slots([page], PAGE, STEPS + 1)


def test_padded_verify_gives_the_eager_logits_and_hidden(engine: Engine) -> None:
    runner, rng = engine.runner, random.Random(1)
    lens = [5, 17, 30]
    tables = _prefill(runner, lens, rng)
    scratch_page, scratch = _scratch(runner)
    graphs = VerifyGraphs(
        runner.model, STEPS, GraphSetup(runner.attn, [1, 4], scratch, capture=False)
    )
    spans = [
        SeqSpan([rng.randrange(2, 1000) for _ in range(STEPS + 1)], n, kv_slots(t, PAGE, n + 4))
        for n, t in zip(lens, tables, strict=True)
    ]
    assert graphs.can_run(spans) and not graphs.can_run(spans + spans)  # 6 > 4
    before = runner.pool.kv_buffer(0).clone()
    hidden, logits = graphs.run(spans)  # 3 sequences on the graph of 4
    after = runner.pool.kv_buffer(0).clone()
    batch = ForwardBatch.build(spans, runner.device, decode=True)
    eager_hidden = runner.model(batch, runner.attn)
    eager_logits = runner.model.compute_logits(eager_hidden)
    assert logits.shape == (3 * (STEPS + 1), runner.model_cfg.vocab_size)
    torch.testing.assert_close(hidden, eager_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
    real = [[s // PAGE, s % PAGE] for span in spans for s in span.kv_slots[span.start :]]
    pad = [[scratch_page, row] for row in range(STEPS + 1)]
    assert _changed(before, after) == sorted(real + pad)


def _eager_chain(
    engine: Engine, spans: list[SeqSpan], hidden: torch.Tensor, tables: list[list[int]]
) -> list[list[int]]:
    """The chain one step at a time on unpadded batches (what ``propose`` does eagerly)."""
    draft, runner = engine.spec.draft, engine.runner
    tokens: list[list[int]] = [[] for _ in spans]
    for _ in range(STEPS - 1):
        batch = ForwardBatch.build(spans, runner.device)
        hidden = draft.forward(batch, hidden, runner.attn)
        step = draft.compute_logits(hidden).argmax(-1).tolist()
        for row, token in zip(tokens, step, strict=True):
            row.append(token)
        spans = [
            SeqSpan([t], s.start + 1, kv_slots(table, PAGE, s.start + 2))
            for s, t, table in zip(spans, step, tables, strict=True)
        ]
    return tokens


def test_padded_draft_chain_gives_the_eager_tokens(engine: Engine) -> None:
    runner, rng = engine.runner, random.Random(2)
    lens = [6, 11, 23]
    tables = _prefill(runner, lens, rng)
    scratch_page, scratch = _scratch(runner)
    chain = DraftChainGraphs(
        engine.spec.draft, STEPS, GraphSetup(runner.attn, [1, 2, 4], scratch, capture=False)
    )
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(len(lens), runner.model_cfg.hidden_size, generator=gen)
    firsts = [rng.randrange(2, 1000) for _ in lens]
    steps = [
        [
            SeqSpan([firsts[i] if step == 0 else 0], n + step, kv_slots(t, PAGE, n + step + 1))
            for i, (n, t) in enumerate(zip(lens, tables, strict=True))
        ]
        for step in range(STEPS - 1)
    ]
    draft_layer = runner.model.num_kv_layers - 1
    before = runner.pool.kv_buffer(draft_layer).clone()
    tokens = chain.run(steps, hidden)
    after = runner.pool.kv_buffer(draft_layer).clone()
    assert tokens.shape == (3, STEPS - 1) and tokens.dtype == torch.int64
    assert tokens.tolist() == _eager_chain(engine, steps[0], hidden, tables)
    real = [[s.kv_slots[-1] // PAGE, s.kv_slots[-1] % PAGE] for spans in steps for s in spans]
    assert _changed(before, after) == sorted(real + [[scratch_page, 0]])


GREEDY = SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True)


def _run(engine: Engine, batch: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    for i, ids in enumerate(batch):
        engine.add_request(Request(f"q{i}", GREEDY, prompt_ids=ids))
    got = drain(engine)
    return {tuple(ids): got[f"q{i}"] for i, ids in enumerate(batch)}


def test_engine_through_the_padded_paths_is_lossless() -> None:
    """Greedy outputs with speculation through the padded verify and chain equal those
    without speculation; both paths served steps; every page comes back."""
    batch = prompts(4, seed=31, hi=24)
    reference = _run(make_engine(enable_prefix_caching=False), batch)
    engine = make_engine(**SPEC)
    scratch = engine.reserve_kv(STEPS + 1)  # pages the scheduler will not hand out
    assert scratch is not None
    runner = engine.runner
    slots = kv_slots(scratch, runner.cfg.page_size, STEPS + 1)
    setup = GraphSetup(runner.attn, [1, 2, 4, 8], slots, capture=False)
    engine.spec.graphs = SpecGraphs.build(engine.spec.draft, STEPS, setup)
    assert _run(engine, batch) == reference
    graphs = engine.spec.graphs
    assert graphs.verify.runs > 0 and graphs.chain is not None and graphs.chain.runs > 0
    assert graphs.extend is not None and graphs.extend.runs > 0
    assert graphs.verify.replays == graphs.chain.replays == graphs.extend.replays == 0
    engine.release_reservation(scratch)
    kv = engine.scheduler.kv
    assert kv.used_pages == 0
    kv.evict_all()
    assert kv.free_pages == kv.num_pages


def test_closing_the_runner_releases_the_speculative_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group's ranks close their runners before leaving the process group, and every
    graph that captured a collective must be gone by then (a TP2 group with MTP hung in
    ``destroy_process_group`` on two H200s while its verify, chain and extend graphs
    lived). On the CPU's uncaptured graph path, each cache gets a stand-in graph; closing
    the runner must reset every one, the speculative ones included."""
    monkeypatch.setenv(EAGER_GRAPH_PATH_ENV, "1")
    engine = make_engine(**SPEC)
    graphs = engine.spec.graphs
    assert engine.runner.graphs is not None and graphs is not None
    assert graphs.chain is not None and graphs.extend is not None
    caches = [
        engine.runner.graphs._graphs,
        graphs.verify._graphs,
        graphs.extend._graphs,
        *graphs.chain._graphs,
    ]
    fakes = [RecordingFakeGraph() for _ in caches]
    for cache, fake in zip(caches, fakes, strict=True):
        cache._graphs[1] = fake
    engine.runner.close()
    assert [fake.resets for fake in fakes] == [1] * len(fakes)
