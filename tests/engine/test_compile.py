"""``enable_torch_compile``: requested only for the CUDA-graph decode forward, and a
compiled forward (dynamo with the eager backend on CPU) gives the eager logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv3serve.engine.compile import COMPILE_MODE, CompiledDecodeModel, decode_model
from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.model_runner import kv_slots
from dsv3serve.forward_batch import SeqSpan


class RecordingCompilerFake:
    """Stands in for torch.compile: records its arguments, returns the function as is."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, fn, **kwargs):
        self.calls.append(kwargs)
        return fn


def test_cpu_engine_never_compiles(monkeypatch: pytest.MonkeyPatch, tiny_bf16_dir) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile must not run off the CUDA-graph path")

    monkeypatch.setattr(torch, "compile", refuse)
    cfg = EngineConfig(model=str(tiny_bf16_dir), num_kv_tokens=256, enable_torch_compile=True)
    assert Engine(cfg).runner.graphs is None
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        EngineConfig(model="tiny", torch_compile_max_bs=0)


def test_decode_model_compiles_only_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = RecordingCompilerFake()
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(torch._dynamo.config, "cache_size_limit", 2)
    model = torch.nn.Linear(2, 2)  # stands in for the model: only .forward is used
    sizes = [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_model(model, EngineConfig(model="tiny"), sizes) is model
    wrapped = decode_model(model, EngineConfig(model="tiny", enable_torch_compile=True), sizes)
    assert isinstance(wrapped, CompiledDecodeModel) and wrapped.max_bs == 32
    assert fake.calls == [{"mode": COMPILE_MODE, "dynamic": False}]
    assert torch._dynamo.config.cache_size_limit >= 6  # one compile per size <= 32


def _decode_spans(engine: Engine, lens: list[int]) -> list[SeqSpan]:
    """Prefill one sequence per length (eager); the spans of their next decode token."""
    runner, page, spans = engine.runner, engine.cfg.page_size, []
    for i, n in enumerate(lens):
        pages = [4 * i + j for j in range(4)]
        ids = [(13 * i + j) % 5000 + 2 for j in range(n)]
        runner.run_spans([SeqSpan(ids, 0, kv_slots(pages, page, n))], None)
        spans.append(SeqSpan([17 + i], n, kv_slots(pages, page, n + 1)))
    return spans


def test_compiled_forward_gives_the_eager_logits(tiny_bf16_dir) -> None:
    """Dynamo traces the real decode forward (the eager backend keeps CPU tests fast); the
    batch over ``max_bs`` takes the uncompiled forward."""
    from dsv3serve.forward_batch import ForwardBatch

    engine = Engine(EngineConfig(model=str(tiny_bf16_dir), num_kv_tokens=512, page_size=16))
    model = engine.runner.model
    compiled = CompiledDecodeModel(model, max_bs=2, backend="eager", mode=None)
    spans = _decode_spans(engine, [5, 20, 33])
    for batch_spans in (spans[:2], spans):
        batch = ForwardBatch.build(batch_spans, engine.runner.device, decode=True)
        eager = model.compute_logits(model(batch, engine.runner.attn))
        got = compiled.compute_logits(compiled(batch, engine.runner.attn))
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
