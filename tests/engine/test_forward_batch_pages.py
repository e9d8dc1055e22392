"""Spans carried as page tables: the batch they build equals the slot-list batch.

The oracle for every slot is the page-table rule written out here per position
(``page_table[p // page_size] * page_size + p % page_size``) on random, shuffled page
tables; the slot-list path of ForwardBatch.build is the reference for the rest.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from attention_cases import BF16_TOL, SMALL_DIMS, make_case, run_layers
from fake_flashinfer import install

import dsv3serve.forward_batch as forward_batch
from dsv3serve.attention.flashinfer_backend import CudaGraphLimits, FlashInferMLAAttention
from dsv3serve.attention.flashinfer_meta import paged_kv_index, pages_kv_index
from dsv3serve.attention.ref import TorchRefAttention
from dsv3serve.engine.group.tp import decode_spans, encode_spans
from dsv3serve.engine.model_runner import kv_slots
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.page_table import pages_of_slots


def oracle_slots(pages: list[int], page_size: int, n: int) -> list[int]:
    return [pages[p // page_size] * page_size + p % page_size for p in range(n)]


def random_spans(
    rng: random.Random, page_size: int, decode: bool
) -> tuple[list[SeqSpan], list[SeqSpan]]:
    """The same random batch as (page-table spans, slot-list spans); page tables are
    longer than needed, as a sequence's with lookahead pages is."""
    free = list(range(400))
    rng.shuffle(free)
    paged, listed = [], []
    for _ in range(rng.randrange(1, 9)):
        start = rng.randrange(0, 90)
        new = 1 if decode else rng.randrange(1, 20)
        tokens = [rng.randrange(2, 1000) for _ in range(new)]
        need = -(-(start + new) // page_size) + rng.randrange(0, 3)
        table, free = free[:need], free[need:]
        sample = rng.random() < 0.8
        paged.append(SeqSpan.from_pages(tokens, start, table, page_size, sample))
        slots = oracle_slots(table, page_size, start + new)
        listed.append(SeqSpan(tokens, start, slots, sample))
    return paged, listed


def oracle_fields(spans: list[SeqSpan]) -> dict:
    """The batch fields by a plain loop over spans and positions (independent of build)."""
    ids, pos, out, kv, qo, kvp, rows = [], [], [], [], [0], [0], []
    for span in spans:
        end = span.start + len(span.token_ids)
        ids += span.token_ids
        pos += list(range(span.start, end))
        out += span.kv_slots[span.start : end]
        kv += span.kv_slots
        qo.append(qo[-1] + len(span.token_ids))
        kvp.append(kvp[-1] + end)
        if span.sample:
            rows.append(qo[-1] - 1)
    return {"input_ids": ids, "positions": pos, "out_slots": out, "kv_slots": kv,
            "logits_indices": rows, "qo_indptr": qo, "kv_indptr": kvp}  # fmt: skip


def assert_matches_oracle(batch: ForwardBatch, spans: list[SeqSpan]) -> None:
    for name, want in oracle_fields(spans).items():
        value = getattr(batch, name)
        got = value if isinstance(value, list) else value.tolist()
        assert got == want, name


def assert_same_batch(got: ForwardBatch, want: ForwardBatch) -> None:
    for name in ("input_ids", "positions", "out_slots", "logits_indices", "kv_slots"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.qo_indptr == want.qo_indptr and got.kv_indptr == want.kv_indptr
    assert got.is_decode == want.is_decode


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_spans_build_the_slot_list_batch(seed: int, page_size: int) -> None:
    rng = random.Random(seed * 31 + page_size)
    paged, listed = random_spans(rng, page_size, decode=seed % 2 == 0)
    got, want = ForwardBatch.build(paged, "cpu"), ForwardBatch.build(listed, "cpu")
    assert got.kv_pages is not None and got.kv_slots_host is None
    assert want.kv_pages is None
    assert_same_batch(got, want)
    assert_matches_oracle(got, listed)  # slot lists from oracle_slots, fields by a loop
    for span, ref in zip(paged, listed, strict=True):
        assert span.kv_slots == ref.kv_slots and span == ref


@pytest.mark.parametrize("seed", range(8))
def test_small_decode_path_equals_the_general_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode batch of up to SMALL_DECODE spans (a graph's padding span as a slot list
    included) is flattened in plain Python; it builds the batch the numpy path builds,
    page tables included, and both match the oracle."""
    rng = random.Random(100 + seed)
    page_size = rng.choice([4, 16])  # size 1 would use more pages than random_spans has
    paged, listed = random_spans(rng, page_size, decode=True)
    if seed % 2:
        padding = SeqSpan([0], 0, [399 * page_size])  # a scratch page
        paged, listed = paged + [padding], listed + [padding]
    assert forward_batch._small_decode(paged) is not None
    fast = ForwardBatch.build(paged, "cpu")
    monkeypatch.setattr(forward_batch, "SMALL_DECODE", 0)
    assert forward_batch._small_decode(paged) is None
    general = ForwardBatch.build(paged, "cpu")
    assert_same_batch(fast, general)
    assert_matches_oracle(fast, listed)
    assert fast.kv_pages is not None and general.kv_pages is not None
    assert fast.kv_pages.page_size == general.kv_pages.page_size
    for name in ("page_indptr", "pages", "kv_lens"):
        got, want = getattr(fast.kv_pages, name), getattr(general.kv_pages, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_flashinfer_page_index_equals_the_slot_checked_one() -> None:
    rng = random.Random(7)
    for _ in range(5):
        paged, listed = random_spans(rng, 16, decode=True)
        want = ForwardBatch.build(listed, "cpu")
        got = pages_kv_index(ForwardBatch.build(paged, "cpu").kv_pages)
        old = paged_kv_index(want.kv_indptr, want.kv_slots_host, 16)
        for field in ("indptr", "lens", "indices"):
            assert torch.equal(getattr(got, field), getattr(old, field)), field
            assert getattr(got, field).dtype == torch.int32
        assert got.page_size == old.page_size == 16


def test_aligned_slot_span_joins_a_paged_batch_and_unaligned_one_falls_back() -> None:
    paged = SeqSpan.from_pages([5], 20, [3, 9], 16)
    padding = SeqSpan([0], 0, [7 * 16])  # a graph's scratch page, as a slot list
    batch = ForwardBatch.build([paged, padding], "cpu")
    assert batch.kv_pages is not None and batch.kv_pages.pages.tolist() == [3, 9, 7]
    stray = SeqSpan([0], 1, [7 * 16 + 3, 40])  # row 3 at position 0: not page-aligned
    mixed = ForwardBatch.build([paged, stray], "cpu")
    assert mixed.kv_pages is None
    assert mixed.kv_slots.tolist() == oracle_slots([3, 9], 16, 21) + [7 * 16 + 3, 40]
    assert mixed.out_slots.tolist() == [9 * 16 + 4, 40]


def test_pages_of_slots_and_kv_slots_helper() -> None:
    assert pages_of_slots(oracle_slots([4, 1, 8], 4, 10), 4) == [4, 1, 8]
    assert pages_of_slots([4, 5, 7, 6], 4) is None
    assert pages_of_slots([5, 6, 7, 8], 4) is None
    rng = random.Random(3)
    table = rng.sample(range(100), 10)
    assert kv_slots(table, 8, 75) == oracle_slots(table, 8, 75)


def test_span_needs_one_cache_description_and_enough_pages() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SeqSpan([1], 0)
    with pytest.raises(ValueError, match="needs 2 pages"):
        SeqSpan([1], 16, page_table=[3], page_size=16)
    with pytest.raises(ValueError, match="needs 3 kv slots"):
        ForwardBatch.build([SeqSpan([1], 2, [0, 1])], "cpu")
    with pytest.raises(ValueError, match="needs 3 kv slots"):  # the small decode path too
        ForwardBatch.build([SeqSpan.from_pages([5], 20, [3, 9], 16), SeqSpan([0], 2, [112])], "cpu")


def test_group_wire_round_trips_paged_and_slot_spans() -> None:
    paged, listed = random_spans(random.Random(11), 4, decode=False)
    spans = paged + listed
    back = decode_spans(encode_spans(spans))
    assert back == spans
    assert [s.page_table for s in back[: len(paged)]] == [s.page_table for s in paged]
    assert all(s.page_table is None for s in back[len(paged) :])


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-wrappers"])
@pytest.mark.parametrize("new", [1, 3], ids=["decode", "verify"])
def test_flashinfer_plans_page_tables_like_the_reference(monkeypatch, graph, new) -> None:
    """flashinfer (fake) over the paged batch vs the torch reference over slot lists."""
    install(monkeypatch)
    case = make_case(SMALL_DIMS, [new] * 4, [1, 15, 16, 70], "cpu", page_size=16, decode=True)
    bounds = case.batch.kv_indptr
    spans = []
    for b in range(case.batch.batch_size):
        slots = case.batch.kv_slots[bounds[b] : bounds[b + 1]].tolist()
        table = pages_of_slots(slots, 16)
        start = len(slots) - new
        spans.append(SeqSpan.from_pages([1] * new, start, table, 16))
    paged = dataclasses.replace(case, batch=ForwardBatch.build(spans, "cpu", decode=True))
    limits = CudaGraphLimits(4, 64) if graph else None
    attn = FlashInferMLAAttention(case.pool, SMALL_DIMS, cuda_graph=limits)
    got = run_layers(attn, paged, SMALL_DIMS, absorbed=True)
    assert attn.index_mode == "page"
    want = run_layers(TorchRefAttention(case.pool, SMALL_DIMS.kv_lora_rank), case, SMALL_DIMS, True)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        scale = w.float().abs().max().item()
        torch.testing.assert_close(g.float(), w.float(), rtol=BF16_TOL, atol=BF16_TOL * scale)
