"""Host cost of one decode step's metadata: ``python -m dsv3serve.bench.engine.host_cost``.

Times, on the CPU and without a GPU, what the host does per decode step before the
forward: ``ModelRunner.spans`` (scheduled items -> spans), ``ForwardBatch.build`` and the
flashinfer backend's ``plan`` (index building and staging; the wrapper's own ``plan`` is
replaced by :class:`FakeFlashinferPlan`, which only copies the indices into the CUDA-graph
buffers as flashinfer does, so flashinfer's C++ planner is not timed). Sequences have
shuffled pages, as an engine's would. Prints a table (median ms) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dsv3serve.attention.base import MLADims
from dsv3serve.engine.model_runner import ModelRunner
from dsv3serve.engine.scheduler.sequence import ScheduledItem, Sequence
from dsv3serve.forward_batch import ForwardBatch
from dsv3serve.kvcache.pool import MLAKVPool

DIMS = MLADims(8, 16, 16, 8, 16, 0.1)  # small: the host work does not depend on widths
STAGES = ("spans", "build", "plan")


class FakeFlashinferPlan:
    """Stands in for ``flashinfer.BatchMLAPagedAttentionWrapper`` (no GPU here): ``plan``
    copies the index arrays into the CUDA-graph buffers as flashinfer's does."""

    def __init__(self, workspace: torch.Tensor, use_cuda_graph: bool = False, **bufs: Any):
        self._graph, self._bufs = use_cuda_graph, bufs

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, *args: Any) -> None:
        kv_indices, kv_len_arr = args[0], args[1]
        if self._graph:
            self._bufs["qo_indptr"].copy_(qo_indptr, non_blocking=True)
            self._bufs["kv_indptr"].copy_(kv_indptr, non_blocking=True)
            self._bufs["kv_indices"][: len(kv_indices)].copy_(kv_indices, non_blocking=True)
            self._bufs["kv_len_arr"].copy_(kv_len_arr, non_blocking=True)


class _FakeRagged:
    def __init__(self, *args: Any, **kw: Any) -> None:
        pass


@contextmanager
def fake_flashinfer() -> Iterator[None]:
    """``import flashinfer`` gives the fakes while inside."""
    module = types.ModuleType("flashinfer")
    module.__version__ = "0.6.18.post1"  # type: ignore[attr-defined]
    module.BatchMLAPagedAttentionWrapper = FakeFlashinferPlan  # type: ignore[attr-defined]
    module.BatchPrefillWithRaggedKVCacheWrapper = _FakeRagged  # type: ignore[attr-defined]
    saved = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = module
    try:
        yield
    finally:
        if saved is None:
            del sys.modules["flashinfer"]
        else:
            sys.modules["flashinfer"] = saved


def decode_items(bs: int, context: int, page_size: int, seed: int) -> list[ScheduledItem]:
    """``bs`` decode items, each the token at position ``context - 1`` over shuffled pages."""
    rng = random.Random(seed)
    per_seq = -(-context // page_size)
    pages = list(range(bs * per_seq))
    rng.shuffle(pages)
    items = []
    for b in range(bs):
        seq = Sequence(f"s{b}", [rng.randrange(2, 1000) for _ in range(context)], 16)
        seq.page_table = pages[b * per_seq : (b + 1) * per_seq]
        slot = seq.page_table[(context - 1) // page_size] * page_size + (context - 1) % page_size
        token = seq.prompt_ids[-1]
        items.append(ScheduledItem(seq, context - 1, 1, [token], [slot], True, True))
    return items


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(bs: int, context: int, page_size: int, graph: bool, repeats: int) -> dict[str, Any]:
    """Median ms of each stage for one batch of ``bs`` sequences of ``context`` tokens."""
    from dsv3serve.attention.flashinfer_backend import CudaGraphLimits, FlashInferMLAAttention

    items = decode_items(bs, context, page_size, seed=bs)
    runner = types.SimpleNamespace(cfg=types.SimpleNamespace(page_size=page_size))
    num_pages = bs * -(-context // page_size) + 1
    pool = MLAKVPool(1, num_pages, page_size, DIMS.kv_cache_dim, torch.bfloat16, "cpu")
    limits = CudaGraphLimits(bs, num_pages * page_size) if graph else None
    attn = FlashInferMLAAttention(pool, DIMS, cuda_graph=limits, workspace_bytes=1024)
    spans = ModelRunner.spans(runner, items)  # type: ignore[arg-type]
    batch = ForwardBatch.build(spans, "cpu", decode=True)
    row: dict[str, Any] = {"batch": bs, "context": context, "page_size": page_size}
    row["spans"] = median_ms(lambda: ModelRunner.spans(runner, items), repeats)  # type: ignore[arg-type]
    row["build"] = median_ms(lambda: ForwardBatch.build(spans, "cpu", decode=True), repeats)
    row["plan"] = median_ms(lambda: attn.plan(batch), repeats)
    row["total"] = sum(row[s] for s in STAGES)
    row["index_mode"] = attn.index_mode
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'batch':>6} {'context':>8} " + " ".join(f"{s:>9}" for s in (*STAGES, "total"))
    print(head + "   (median ms per step, host only)")
    for r in rows:
        cells = " ".join(f"{r[s]:9.3f}" for s in (*STAGES, "total"))
        print(f"{r['batch']:>6} {r['context']:>8} {cells}   {r['index_mode']} index")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[64, 128])
    p.add_argument("--context", type=int, nargs="+", default=[4096])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-graph", action="store_true", help="plan the eager wrapper")
    p.add_argument("--json", default="bench_host_cost.json")
    args = p.parse_args(argv)
    rows = []
    with fake_flashinfer(), torch.inference_mode():
        for bs in args.batch:
            for ctx in args.context:
                rows.append(measure(bs, ctx, args.page_size, not args.no_graph, args.repeats))
    print_table(rows)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
