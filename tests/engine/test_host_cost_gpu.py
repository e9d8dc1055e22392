"""Page-table spans on a GPU: the device batch equals the slot-list one, the real
flashinfer kernels planned from page ids (pinned staging, CUDA-graph wrappers) match the
torch reference over slot lists, and a graph replay over page-table spans gives the eager
slot-list step's logits."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")

from attention_cases import BF16_TOL, DEEPSEEK_DIMS, make_case, run_layers  # noqa: E402
from test_cuda_graph_gpu import DEEPSEEK_ATTENTION, PAGE, _config, _prefill  # noqa: E402
from test_forward_batch_pages import assert_same_batch, random_spans  # noqa: E402

from dsv3serve.attention.flashinfer_backend import (  # noqa: E402
    CudaGraphLimits,
    FlashInferMLAAttention,
)
from dsv3serve.attention.ref import TorchRefAttention  # noqa: E402
from dsv3serve.engine.engine import Engine  # noqa: E402
from dsv3serve.forward_batch import ForwardBatch, SeqSpan  # noqa: E402
from dsv3serve.model.tiny import make_tiny_checkpoint  # noqa: E402
from dsv3serve.page_table import pages_of_slots  # noqa: E402


@pytest.fixture(scope="module")
def graph_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The tiny FP8 checkpoint with DeepSeek-V3 attention, flashinfer + CUDA graphs."""
    ckpt = make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_pages"), fp8=True, overrides=DEEPSEEK_ATTENTION
    )
    return Engine(_config(ckpt))


@pytest.mark.parametrize("seed", range(4))
def test_paged_device_batch_equals_the_slot_list_batch(seed: int) -> None:
    paged, listed = random_spans(random.Random(seed), 16, decode=seed % 2 == 0)
    got = ForwardBatch.build(paged, "cuda")
    assert got.kv_pages is not None and got.input_ids.is_cuda
    assert_same_batch(got, ForwardBatch.build(listed, "cuda"))


def _paged_case(case, new: int, page_size: int):
    bounds, spans = case.batch.kv_indptr, []
    for b in range(case.batch.batch_size):
        slots = case.batch.kv_slots[bounds[b] : bounds[b + 1]].tolist()
        start = len(slots) - new
        spans.append(
            SeqSpan.from_pages([1] * new, start, pages_of_slots(slots, page_size), page_size)
        )
    return dataclasses.replace(case, batch=ForwardBatch.build(spans, "cuda", decode=True))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-wrappers"])
@pytest.mark.parametrize("new", [1, 3], ids=["decode", "verify"])
def test_flashinfer_from_page_tables_matches_the_reference(graph: bool, new: int) -> None:
    cached = [1, 63, 64, 65, 500, 1000, 2047, 129]
    case = make_case(DEEPSEEK_DIMS, [new] * 8, cached, "cuda", page_size=64, decode=True)
    paged = _paged_case(case, new, 64)
    limits = CudaGraphLimits(8, 1 << 12) if graph else None
    attn = FlashInferMLAAttention(case.pool, DEEPSEEK_DIMS, cuda_graph=limits)
    got = run_layers(attn, paged, DEEPSEEK_DIMS, absorbed=True)
    assert attn.index_mode == "page"
    ref = TorchRefAttention(case.pool, DEEPSEEK_DIMS.kv_lora_rank)
    want = run_layers(ref, case, DEEPSEEK_DIMS, absorbed=True)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        scale = w.float().abs().max().item()
        torch.testing.assert_close(g.float(), w.float(), rtol=BF16_TOL, atol=BF16_TOL * scale)


def test_graph_replay_over_page_tables_matches_eager_slot_lists(graph_engine: Engine) -> None:
    runner, rng = graph_engine.runner, random.Random(5)
    listed = _prefill(runner, [rng.randint(1, 300) for _ in range(5)], rng)
    paged = [
        SeqSpan.from_pages(s.token_ids, s.start, pages_of_slots(s.kv_slots, PAGE), PAGE)
        for s in listed
    ]
    replays = runner.graphs.replays
    graph_logits = runner.run_spans(paged, None).logits
    assert runner.graphs.replays == replays + 1
    graphs, runner.graphs = runner.graphs, None
    try:
        eager_logits = runner.run_spans(listed, None).logits
    finally:
        runner.graphs = graphs
    scale = eager_logits.abs().max()
    torch.testing.assert_close(graph_logits, eager_logits, rtol=0.02, atol=0.02 * scale)
