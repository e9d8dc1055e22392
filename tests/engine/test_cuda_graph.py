"""Decode CUDA graphs: which steps they take, and that CPU runs never build them."""

from __future__ import annotations

import torch
from graph_fakes import RecordingFakeGraph

from dsv3serve.engine.cuda_graph import capture_sizes, graphable
from dsv3serve.forward_batch import SeqSpan


def _decode(n: int) -> list[SeqSpan]:
    return [SeqSpan([5], 3, [0, 1, 2, 3]) for _ in range(n)]


def test_capture_sizes_cover_every_batch_up_to_the_max() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    for max_bs in (1, 5, 64, 100):
        sizes = capture_sizes(max_bs)
        assert sizes[-1] == max_bs
        assert all(any(s >= b for s in sizes) for b in range(1, max_bs + 1))


def test_only_plain_decode_steps_are_graphable() -> None:
    assert graphable(_decode(4), 4)
    assert not graphable(_decode(5), 4)  # over the largest captured batch
    assert not graphable([], 4)
    assert not graphable([SeqSpan([5, 6], 2, [0, 1, 2, 3])], 4)  # verify / extend
    assert not graphable([SeqSpan([5], 3, [0, 1, 2, 3], sample=False)], 4)


def test_cpu_runner_has_no_graphs_and_no_scratch_page(tiny_fp8_dir) -> None:
    from dsv3serve.engine.config import EngineConfig
    from dsv3serve.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_fp8_dir), num_kv_tokens=1024, page_size=16))
    assert engine.runner.graphs is None
    assert engine.runner.num_pages == engine.runner.pool.num_pages == 64
    assert engine.runner.device == torch.device("cpu")


def test_padded_static_batch_gives_the_eager_logits(tiny_bf16_dir) -> None:
    """The graph path's padding and static buffers, run eagerly on CPU (no capture): the
    real rows' logits equal the unpadded step's, and padding writes only the scratch page."""
    from dsv3serve.engine.config import EngineConfig
    from dsv3serve.engine.cuda_graph import DecodeGraphs
    from dsv3serve.engine.engine import Engine
    from dsv3serve.engine.model_runner import kv_slots

    page = 16
    cfg = EngineConfig(model=str(tiny_bf16_dir), num_kv_tokens=1024, page_size=page)
    runner = Engine(cfg).runner
    scratch_page = runner.pool.num_pages - 1
    graphs = DecodeGraphs(
        runner.model, runner.attn, runner.device, [1, 4], scratch_page * page, capture=False
    )
    spans = []
    for i, n in enumerate((5, 17, 30)):
        pages = [2 * i, 2 * i + 1]
        ids = [(7 * i + j) % 1000 + 2 for j in range(n)]
        runner.run_spans([SeqSpan(ids, 0, kv_slots(pages, page, n))], None)
        spans.append(SeqSpan([11 + i], n, kv_slots(pages, page, n + 1)))
    before = runner.pool.kv_buffer(0).clone()
    padded = graphs.run(spans)  # 3 sequences on the batch of 4
    after = runner.pool.kv_buffer(0).clone()
    eager = runner.run_spans(spans, None).logits
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    changed = (after != before).any(-1).nonzero().tolist()  # [page, row] pairs written
    assert sorted(changed) == sorted(
        [[s.kv_slots[s.start] // page, s.kv_slots[s.start] % page] for s in spans]
        + [[scratch_page, 0]]
    )


def test_released_graphs_are_reset_and_later_runs_are_eager() -> None:
    from dsv3serve.engine.graph_capture import GraphCache

    cache: GraphCache[str] = GraphCache(torch.device("cpu"))
    graphs = {4: RecordingFakeGraph(), 8: RecordingFakeGraph()}
    cache._graphs.update(graphs)
    cache._outputs.update({4: "static 4", 8: "static 8"})
    cache.release()
    assert [g.resets for g in graphs.values()] == [1, 1]
    assert cache.run(4, lambda: "eager") == "eager"
    cache.release()  # nothing left: no second reset
    assert [g.resets for g in graphs.values()] == [1, 1]
