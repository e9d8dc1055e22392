"""Inputs and the comparison for the RoPE + KV-cache write kernel against its reference
(used by the interpreter and the GPU tests); bounds in tests/support/mla_fusion_cases.py.

The pool starts poisoned (NaN, 0xFF for e4m3): rows the kernel must not touch stay
poisoned, the rows it writes hold no NaN. An e4m3 row is checked exactly against what a real
``MLAKVPool.write`` on the same device stores for the kernel's own bf16 row, which the same
kernel writes into a bf16 pool; that bf16 row is checked against the reference by the RoPE
bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from mla_fusion_cases import assert_rope_close, poison_, rope_magnitude

from dsv3serve.config import YarnScaling
from dsv3serve.kvcache.pool import MLAKVPool
from dsv3serve.layers.rotary import RotaryEmbedding

PAGE_SIZE = 4
DSV3_YARN = YarnScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
RopeWrite = Callable[..., torch.Tensor | None]


@dataclass(frozen=True)
class RopeCase:
    latent: torch.Tensor  # [T, R + P] bf16
    cos: torch.Tensor  # [T, P/2] float32
    sin: torch.Tensor
    slots: torch.Tensor  # [T] int64, distinct
    kv: torch.Tensor  # [pages, PAGE_SIZE, R + P], poisoned
    scales: torch.Tensor | None  # [pages, PAGE_SIZE] float32, poisoned (e4m3 pools)
    q_pe: torch.Tensor | None  # [T, H, P] bf16, a strided view (as a slice of q_b's output)

    def fresh_pool(self, dtype: torch.dtype | None = None) -> RopeCase:
        """The same inputs over a new poisoned pool (of ``dtype``, default the same)."""
        dtype = dtype or self.kv.dtype
        kv = poison_(torch.empty(self.kv.shape, dtype=dtype, device=self.kv.device))
        fp8 = dtype == torch.float8_e4m3fn
        scales = poison_(torch.empty(kv.shape[:2], device=kv.device)) if fp8 else None
        return replace(self, kv=kv, scales=scales)

    def run(self, fn: RopeWrite) -> torch.Tensor | None:
        return fn(self.latent, self.cos, self.sin, self.slots, self.kv, self.scales, self.q_pe)


def rope_inputs(
    t: int,
    r: int,
    p: int,
    heads: int,
    dtype: torch.dtype,
    device: str,
    g: torch.Generator,
    with_q: bool = True,
) -> RopeCase:
    """Normal latents (rows over four orders of magnitude), YaRN cos/sin at random positions
    up to 160k, distinct random slots in a poisoned pool of ``dtype`` with twice the rows
    needed (at least 24)."""
    rows = torch.logspace(-2, 2, t)[:, None]
    latent = (torch.randn(t, r + p, generator=g) * rows).to(torch.bfloat16)
    positions = torch.randint(0, 163840, (t,), generator=g)
    cos, sin = RotaryEmbedding(p, 10000.0, DSV3_YARN).cos_sin(positions)
    pages = max(6, -(-2 * t // PAGE_SIZE))
    slots = torch.randperm(pages * PAGE_SIZE, generator=g)[:t]
    q_full = torch.randn(t, max(heads, 1), 2 * p, generator=g).to(torch.bfloat16)
    q_pe = q_full[:, :heads, p:] if with_q else None
    kv = torch.empty(pages, PAGE_SIZE, r + p, dtype=dtype)
    case = RopeCase(latent, cos, sin, slots, kv, None, q_pe)
    moved = {k: v.to(device) for k, v in vars(case).items() if isinstance(v, torch.Tensor)}
    return replace(case, **moved).fresh_pool()


def _pool_quantised(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a real e4m3 ``MLAKVPool.write`` stores for bf16 ``rows`` [T, D] on their
    device: the rows and their scales (the unfused path the kernel must equal)."""
    t, d = rows.shape
    pool = MLAKVPool(1, -(-t // PAGE_SIZE), PAGE_SIZE, d, torch.float8_e4m3fn, rows.device)
    pool.write(0, torch.arange(t, device=rows.device), rows)
    scales = pool.scale_buffer(0)
    assert scales is not None
    return pool.kv_buffer(0).view(-1, d)[:t], scales.view(-1)[:t]


def assert_untouched(kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Rows outside ``slots`` still hold the poison; rows at ``slots`` hold none."""
    flat = kv.view(-1, kv.shape[-1]).view(torch.uint8) if kv.element_size() == 1 else None
    other = torch.ones(kv.shape[0] * kv.shape[1], dtype=torch.bool, device=kv.device)
    other[slots] = False
    rows = kv.view(-1, kv.shape[-1])
    if flat is not None:
        assert (flat[other] == 0xFF).all(), "the kernel wrote rows outside its slots"
        assert not (flat[slots] == 0xFF).any(), "the kernel left entries of its rows unwritten"
        return
    assert rows[other].isnan().all(), "the kernel wrote rows outside its slots"
    assert not rows[slots].isnan().any(), "the kernel left entries of its rows unwritten"


def check_against_reference(case: RopeCase, kernel: RopeWrite, ref: RopeWrite) -> None:
    """The kernel's cache rows and rotated q_pe against the reference's (see the docstring)."""
    r = case.latent.shape[1] - 2 * case.cos.shape[1]
    bf16 = case.fresh_pool(torch.bfloat16)
    q_out = bf16.run(kernel)
    bf16_ref = bf16.fresh_pool()
    q_ref = bf16_ref.run(ref)
    assert_untouched(bf16.kv, case.slots)
    rows, rows_ref = (c.kv.view(-1, c.kv.shape[-1])[case.slots] for c in (bf16, bf16_ref))
    assert torch.equal(rows[:, :r], rows_ref[:, :r]), "the latent part is not copied as it is"
    magnitude = rope_magnitude(case.latent[:, r:], case.cos, case.sin)
    assert_rope_close(rows[:, r:], rows_ref[:, r:], magnitude)
    if case.q_pe is not None:
        assert q_out is not None and q_ref is not None and q_out.is_contiguous()
        assert_rope_close(q_out, q_ref, rope_magnitude(case.q_pe, case.cos, case.sin))
    if case.scales is not None:
        fp8 = case.fresh_pool()
        fp8.run(kernel)
        assert_untouched(fp8.kv, case.slots)
        q, scale = _pool_quantised(rows)
        got = fp8.kv.view(-1, fp8.kv.shape[-1])[case.slots]
        assert fp8.scales is not None
        assert torch.equal(fp8.scales.view(-1)[case.slots], scale), "row scales differ"
        assert torch.equal(got.view(torch.uint8), q.view(torch.uint8)), "e4m3 rows differ"
        assert fp8.scales.isnan().sum() == fp8.scales.numel() - len(case.slots), (
            "the kernel wrote scales outside its slots"
        )


def check_layer_scaled(case: RopeCase, write: RopeWrite, layer_scale: float = 0.25) -> None:
    """FlashMLA's fp8 layout (one scale per layer, no scale buffer): ``write``'s e4m3 rows
    are exactly what ``MLAKVPool(fp8_scales="layer").write`` stores for ``write``'s own bf16
    rows (values past 448 * scale saturate on both), and it touches no other row. Scale
    0.25 makes the largest of ``rope_inputs``' latents saturate."""
    d = case.latent.shape[1]
    bf16 = case.fresh_pool(torch.bfloat16)
    bf16.run(write)
    rows = bf16.kv.view(-1, d)[case.slots]
    fp8 = replace(case.fresh_pool(torch.float8_e4m3fn), scales=None)
    pool = MLAKVPool(1, fp8.kv.shape[0], PAGE_SIZE, d, torch.float8_e4m3fn, rows.device,
                     fp8_scales="layer", layer_scale=layer_scale)  # fmt: skip
    inv = pool.layer_inv_scale(0)
    q = write(fp8.latent, fp8.cos, fp8.sin, fp8.slots, fp8.kv, None, fp8.q_pe, inv)
    assert (q is None) == (fp8.q_pe is None)
    assert_untouched(fp8.kv, case.slots)
    pool.write(0, case.slots, rows)
    got = fp8.kv.view(-1, d)[case.slots].view(torch.uint8)
    want = pool.kv_buffer(0).view(-1, d)[case.slots].view(torch.uint8)
    assert torch.equal(got, want), f"{write.__name__}: e4m3 rows differ from the pool's"
