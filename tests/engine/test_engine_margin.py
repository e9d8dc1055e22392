"""CPU checks of the cross-engine greedy comparison in ``engine_margin``.

The GPU test (test_gpu_engine_vs_cpu.py) compares the fast path with the float32 CPU
reference. Here the same harness runs on CPU: a bf16 CPU engine (rounding differs from
the reference, as on the GPU) passes it, and an engine that reads one layer's KV from
the wrong page fails it, so the setup has margin to spare yet still sees a cache bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_margin import (
    Generation,
    assert_same_greedy,
    first_step_logits,
    generate,
    make_margin_checkpoint,
    select_prompts,
)

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine

NEW_TOKENS = 6
MIN_MARGIN = 0.35
MULTIPLE = 3.0
PAGE = 64


def _engine(ckpt: Path, dtype: str) -> Engine:
    cfg = EngineConfig(
        model=str(ckpt),
        device="cpu",
        dtype=dtype,
        page_size=PAGE,
        num_kv_tokens=8192,
        chunked_prefill_size=128,
    )
    return Engine(cfg)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    ckpt, live = make_margin_checkpoint(tmp_path_factory.mktemp("margin"), fp8=True, overrides={})
    ref = _engine(ckpt, "float32")
    prompts, want = select_prompts(ref, NEW_TOKENS, MIN_MARGIN)
    return ckpt, live, prompts, want, first_step_logits(ref, prompts)


def test_checkpoint_is_a_sign_decision(setup) -> None:
    _, live, prompts, want, logits = setup
    assert torch.equal(logits[:, live[0]], -logits[:, live[1]])
    others = torch.ones(logits.shape[1], dtype=torch.bool)
    others[live] = False
    assert not logits[:, others].any()  # exact zeros: no error from the dead rows
    assert {t for toks in want.tokens for t in toks} <= set(live)
    assert want.min_margin >= MIN_MARGIN


def test_bf16_engine_passes(setup) -> None:
    ckpt, _, prompts, want, ref_logits = setup
    bf16 = _engine(ckpt, "bfloat16")
    error = (first_step_logits(bf16, prompts) - ref_logits).abs().max().item()
    assert_same_greedy(want, generate(bf16, prompts, NEW_TOKENS), error, MULTIPLE)


def _read_wrong_page(engine: Engine) -> None:
    """Every layer reads each slot from its neighbour page (page index xor 1)."""
    pool, read = engine.runner.pool, engine.runner.pool.read
    pool.read = lambda lid, slots: read(lid, slots ^ PAGE)


def test_wrong_kv_page_changes_tokens(setup) -> None:
    ckpt, _, prompts, want, _ = setup
    broken = _engine(ckpt, "float32")
    _read_wrong_page(broken)
    got: Generation = generate(broken, prompts, NEW_TOKENS)
    assert got.tokens != want.tokens
    with pytest.raises(AssertionError, match="differ from reference"):
        assert_same_greedy(want, got, logit_error=1e-3, multiple=MULTIPLE)
