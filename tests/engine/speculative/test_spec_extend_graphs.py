"""The padded (graphable) draft extend on the CPU, capture off: over all ``k + 1``
positions of every sequence it leaves the eager extend's draft states and draft KV at the
committed positions, writes nothing outside each sequence's own lookahead and the scratch
page, and an engine using it keeps the eager-extend engine's states step for step, stays
lossless (greedy) and leaks no page, also when sequences finish mid-batch."""

from __future__ import annotations

import random

import pytest
import torch
from engine_util import make_engine, prompts
from test_spec_graphs import PAGE, SPEC, STEPS, _changed, _prefill, _scratch

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.graph_capture import GraphSetup
from dsv3serve.engine.model_runner import kv_slots
from dsv3serve.engine.request import Request
from dsv3serve.engine.speculative.extend_graphs import ExtendGraphs
from dsv3serve.engine.speculative.graphs import SpecGraphs
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.sampling.sampling_params import SamplingParams

WIDTH = STEPS + 1
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def engine(tiny_bf16_dir) -> Engine:
    cfg = EngineConfig(model=str(tiny_bf16_dir), num_kv_tokens=1024, page_size=PAGE, **SPEC)
    return Engine(cfg)


def _eager_extend(engine: Engine, lens, tables, ids, hidden, accepted):
    """What ``SpecDecoder.extend`` does eagerly: the committed positions only (MHA form)."""
    runner, draft = engine.runner, engine.spec.draft
    spans = [
        SeqSpan(row[: a + 1], n, kv_slots(t, PAGE, n + a + 1))
        for n, t, row, a in zip(lens, tables, ids, accepted, strict=True)
    ]
    rows = [i * WIDTH + j for i, a in enumerate(accepted) for j in range(a + 1)]
    batch = ForwardBatch.build(spans, runner.device)
    out = draft.forward(batch, hidden[torch.tensor(rows)], runner.attn)
    last = out[batch.logits_indices]
    return last, draft.compute_logits(last).argmax(-1)


def test_padded_extend_gives_the_eager_states_and_committed_kv(engine: Engine) -> None:
    runner, rng = engine.runner, random.Random(5)
    scratch_page, scratch = _scratch(runner)
    setup = GraphSetup(runner.attn, [1, 4], scratch, capture=False)
    graphs = ExtendGraphs(engine.spec.draft, STEPS, setup)
    layer = runner.model.num_kv_layers - 1
    kv = runner.pool.kv_buffer(layer)
    for trial in range(3):
        lens = [rng.randint(1, 30) for _ in range(3)]
        tables = _prefill(runner, lens, rng)
        accepted = [rng.randint(0, STEPS) for _ in lens]  # committed: accepted + 1
        committed = [[rng.randrange(2, 1000) for _ in range(a + 1)] for a in accepted]
        garbage = [[rng.randrange(2, 1000) for _ in range(STEPS - a)] for a in accepted]
        ids = [c + g for c, g in zip(committed, garbage, strict=True)]
        gen = torch.Generator().manual_seed(trial)
        hidden = torch.randn(len(lens) * WIDTH, runner.model_cfg.hidden_size, generator=gen)
        kv[scratch_page] = float("nan")  # so that the padding's writes show
        before = kv.clone()
        want_hidden, want_tokens = _eager_extend(engine, lens, tables, ids, hidden, accepted)
        eager_kv = kv.clone()
        kv.copy_(before)
        spans = [
            SeqSpan(row, n, kv_slots(t, PAGE, n + WIDTH), False)
            for n, t, row in zip(lens, tables, ids, strict=True)
        ]
        rows = [i * WIDTH + a for i, a in enumerate(accepted)]
        got_hidden, got_tokens = graphs.run(spans, hidden, rows)  # 3 padded to 4
        assert got_tokens.tolist() == want_tokens.tolist()
        torch.testing.assert_close(got_hidden, want_hidden, **TOL)
        real = [[s // PAGE, s % PAGE] for span in spans for s in span.kv_slots[span.start :]]
        pad = [[scratch_page, row] for row in range(WIDTH)]
        assert _changed(before, kv) == sorted(real + pad)  # own lookahead + scratch only
        done = [s for n, t, a in zip(lens, tables, accepted, strict=True)
                for s in kv_slots(t, PAGE, n + a + 1)[n:]]  # fmt: skip
        flat_graph, flat_eager = kv.view(-1, kv.shape[-1]), eager_kv.view(-1, kv.shape[-1])
        torch.testing.assert_close(flat_graph[done], flat_eager[done], **TOL)
    assert graphs.runs == 3 and graphs.replays == 0


def _spec_engine(extend_graphs: bool) -> tuple[Engine, list[int]]:
    """A speculating engine with every spec graph path (capture off) on reserved scratch
    pages; ``extend_graphs=False`` keeps the extend eager. Same page layout either way."""
    engine = make_engine(**SPEC)
    scratch = engine.reserve_kv(WIDTH)
    assert scratch is not None
    runner = engine.runner
    slots = kv_slots(scratch, runner.cfg.page_size, WIDTH)
    setup = GraphSetup(runner.attn, [1, 2, 4, 8], slots, capture=False)
    graphs = SpecGraphs.build(engine.spec.draft, STEPS, setup)
    if not extend_graphs:
        graphs.extend = None
    engine.spec.graphs = graphs
    return engine, scratch


def _draft_rows(engine: Engine) -> dict[str, torch.Tensor]:
    """Each running sequence's draft-layer KV rows at its computed positions."""
    kv = engine.runner.pool.kv_buffer(engine.runner.model.num_kv_layers - 1)
    flat = kv.view(-1, kv.shape[-1])
    out = {}
    for state in engine._states.values():
        seq = state.seq
        if seq.page_table and not seq.is_finished:
            out[seq.seq_id] = flat[kv_slots(seq.page_table, PAGE, seq.num_computed_tokens)]
    return out


def _compare_states(graphed: Engine, eager: Engine) -> None:
    g_states, e_states = graphed.spec._states, eager.spec._states
    assert g_states.keys() == e_states.keys()
    for seq_id, want in e_states.items():
        got = g_states[seq_id]
        assert (got.num_tokens, got.token) == (want.num_tokens, want.token), seq_id
        torch.testing.assert_close(got.hidden, want.hidden, **TOL)
    g_rows, e_rows = _draft_rows(graphed), _draft_rows(eager)
    assert g_rows.keys() == e_rows.keys()
    for seq_id, want in e_rows.items():
        torch.testing.assert_close(g_rows[seq_id], want, **TOL)


MAX_NEW = (5, 8, 10, 6)


def _stop_run(reference: dict[str, list[int]]) -> tuple[list[SamplingParams], dict]:
    """q1 also stops at its first new output token after the first (a decode step where
    every item has the full lookahead): the params, and the reference cut there."""
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    out = reference["q1"]
    at = next(i for i, t in enumerate(out) if i > 0 and t not in out[:i])
    params[1] = SamplingParams(
        temperature=0, max_new_tokens=MAX_NEW[1], ignore_eos=True, stop_token_ids=[out[at]]
    )
    return params, {**reference, "q1": out[: at + 1]}


def _oracle_drafts(engine: Engine, reference: dict[str, list[int]], seed: int) -> None:
    """Replace each chain's drafts by the greedy continuation cut at a random draft (made
    wrong), so that steps accept 0 .. k drafts; lengths (and so graph paths) unchanged."""
    propose, rng = engine.spec.propose, random.Random(seed)

    def oracle(items):
        drafts = propose(items)
        for item in items:
            row = drafts.get(item.seq_id)
            if row:
                done = len(item.seq.output_ids)
                want = reference[item.seq.request_id][done : done + len(row)]
                row[:] = want + [0] * (len(row) - len(want))
                cut = rng.randint(0, len(row))
                if cut < len(row):
                    row[cut] = (row[cut] + 1) % 1000
        return drafts

    engine.spec.propose = oracle


def _add(engine: Engine, batch: list[list[int]], params: list[SamplingParams]) -> None:
    for i, (ids, p) in enumerate(zip(batch, params, strict=True)):
        engine.add_request(Request(f"q{i}", p, prompt_ids=ids))


def test_engine_with_the_padded_extend_keeps_the_eager_states() -> None:
    """Lockstep, with drafts that accept 0 .. k tokens: after every step the padded-extend
    engine has the eager-extend engine's outputs, draft states and committed draft KV;
    both equal plain greedy decoding; the padded extend served steps, also one where a
    sequence stopped; no page leaks."""
    batch = prompts(4, seed=41, hi=24)
    plain = make_engine(enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for m in MAX_NEW]
    _add(plain, batch, params)
    full = _drain(plain)
    params, reference = _stop_run(full)
    (graphed, g_scratch), (eager, e_scratch) = _spec_engine(True), _spec_engine(False)
    _oracle_drafts(graphed, full, seed=7)
    _oracle_drafts(eager, full, seed=7)
    _add(graphed, batch, params)
    _add(eager, batch, params)
    got: dict[str, list[int]] = {}
    extend, stopped_in_graph = graphed.spec.graphs.extend, False
    while graphed.has_unfinished() or eager.has_unfinished():
        runs = extend.runs
        outs, eager_outs = graphed.step(), eager.step()
        assert [(o.request_id, o.token_ids, o.finished) for o in outs] == [
            (o.request_id, o.token_ids, o.finished) for o in eager_outs
        ]
        stopped_in_graph |= extend.runs > runs and any(o.finish_reason == "stop" for o in outs)
        _compare_states(graphed, eager)
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert got == reference
    assert extend.runs > 0 and stopped_in_graph
    stats = graphed.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens and stats.accepted_at[-1] > 0
    for done, scratch in ((graphed, g_scratch), (eager, e_scratch)):
        done.release_reservation(scratch)
        kv = done.scheduler.kv
        assert kv.used_pages == 0
        kv.evict_all()
        assert kv.free_pages == kv.num_pages


def _drain(engine: Engine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    return got
