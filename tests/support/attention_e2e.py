"""The whole model run step by step with two attention backends on the same tokens.

Teacher-forced (the tokens are fixed in advance), so the backends are compared on every
step's logits, not on argmax choices that a rounding difference could flip. The model
should be dense (``DENSE``): a rounding difference can flip a MoE routing choice and
move one row's logits by O(1), which would hide what is compared. Each
backend owns its pool. The steps cover every attention path: a prefill, an extend over
a cached prefix, decode steps, and a speculative verify (3 tokens per sequence).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from dsv3serve.attention.base import AttentionBackend
from dsv3serve.forward_batch import ForwardBatch, SeqSpan
from dsv3serve.kvcache.pool import FP8Scales, MLAKVPool
from dsv3serve.model.deepseek_v3 import DeepseekV3ForCausalLM

DENSE = {"first_k_dense_replace": 99}  # tiny-checkpoint overrides: no MoE layer
MakeBackend = Callable[[MLAKVPool], AttentionBackend]


def _schedule(prompt_lens: list[int], decode_steps: int) -> list[tuple[list[int], bool]]:
    """Per step, the new tokens per sequence, and whether the step is decode-shaped."""
    first = [max(1, n // 3) for n in prompt_lens]
    steps = [(first, False), ([n - f for n, f in zip(prompt_lens, first, strict=True)], False)]
    steps += [([1] * len(prompt_lens), True)] * decode_steps
    return steps + [([3] * len(prompt_lens), True)]


@torch.inference_mode()
def step_logits(
    model: DeepseekV3ForCausalLM,
    make_backend: MakeBackend,
    prompt_lens: list[int],
    page_size: int,
    decode_steps: int = 3,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
    fp8_scales: FP8Scales = "token",
) -> list[torch.Tensor]:
    """Float32 logits of every new token of every step; the pool stores ``kv_dtype``
    (default: the model's dtype; fp8 with ``fp8_scales``)."""
    device = next(model.parameters()).device
    rng = random.Random(seed)
    schedule = _schedule(prompt_lens, decode_steps)
    total = [sum(step[0][b] for step in schedule) for b in range(len(prompt_lens))]
    pages = [-(-n // page_size) for n in total]
    width, dtype = model.cfg.kv_cache_dim, kv_dtype or model.opts.dtype
    num_pages = sum(pages) + 2
    pool = MLAKVPool(
        model.num_kv_layers, num_pages, page_size, width, dtype, device, fp8_scales=fp8_scales
    )
    free = list(range(pool.num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages]
    backend, done, out = make_backend(pool), [0] * len(prompt_lens), []
    for new, decode in schedule:
        spans = []
        for b, n in enumerate(new):
            end = done[b] + n
            slots = [tables[b][p // page_size] * page_size + p % page_size for p in range(end)]
            tokens = [rng.randrange(2, model.cfg.vocab_size) for _ in range(n)]
            spans.append(SeqSpan(tokens, done[b], slots))
            done[b] = end
        batch = ForwardBatch.build(spans, device, decode=decode)
        out.append(model.compute_logits(model(batch, backend)).float())
    return out


def assert_logits_close(got: list[torch.Tensor], want: list[torch.Tensor], rel_tol: float) -> None:
    """Each step's logits within ``rel_tol`` (relative L2 norm; each row within twice that),
    argmax equal wherever the reference's top-2 margin is over 10x that noise.

    The tolerance is the model's bf16 noise floor, not the kernels' error: in the tiny
    model a 1e-3 relative perturbation of the attention output already moves the logits
    by ~1e-2, as every later bf16 op rounds differently. A wrong mask or a wrong page
    moves them by O(1).
    """
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < rel_tol, f"step {step}: logits differ by {rel:.2e} (relative L2)"
        row_rel = ((g - w).norm(dim=-1) / w.norm(dim=-1)).max().item()
        assert row_rel < 2 * rel_tol, f"step {step}: a row's logits differ by {row_rel:.2e}"
        top2 = w.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 10 * rel_tol * w.std(dim=-1)
        same = g.argmax(-1) == w.argmax(-1)
        assert bool(same[clear].all()), f"step {step}: argmax differs on a clear row"
