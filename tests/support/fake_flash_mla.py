"""FakeFlashMLACPU: a stand-in for sgl-flash-mla 1.0.0's dense decode API, in plain torch.

FlashMLA needs an SM90 GPU, so the CPU tests install this instead (:func:`install`). It is
written from the package's Python interface (``flash_mla/flash_mla_interface.py``): the
signatures of ``get_mla_decoding_metadata`` and ``flash_mla_with_kvcache``,
``FlashMLASchedMeta``, the dense legacy path's checks (``use_legacy``, descales only with
``is_fp8_kvcache``, fp8 metadata before the first fp8 call), the shapes and dtypes it takes
(q [B, s_q, H, 576], k_cache [blocks, 64, 1, 576], int32 block table and lengths), the
causal mask aligned bottom-right, outputs [B, s_q, H, 512] bf16 and LSE [B, H, s_q].

Its scheduler metadata is a function of the lengths it was planned for, and every call
checks the metadata it is given against the lengths it is given, so a stale plan (a graph
replayed after a plan that did not refresh its buffers) fails here, where the real kernel
would read the wrong splits. Every call is recorded in ``module.calls``. The GPU tests
(tests/attention/test_attention_flashmla_gpu.py) check the real kernels.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

HEAD_DIM, HEAD_DIM_V, PAGE = 576, 512, 64
FAKE_SMS = 132
E4M3 = torch.float8_e4m3fn


@dataclass
class FlashMLASchedMeta:
    """The fields of the real class this backend touches."""

    have_initialized: bool = False
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def _num_sm_parts(num_q_tokens_per_head_k: int) -> int:
    return max(1, FAKE_SMS // -(-num_q_tokens_per_head_k // 64))


def _splits(seqlens: torch.Tensor) -> torch.Tensor:
    """One split per page of each sequence, as an exclusive prefix sum [B + 1]."""
    per_seq = (seqlens.long() + PAGE - 1) // PAGE
    return torch.cat([per_seq.new_zeros(1), per_seq.cumsum(0)]).to(torch.int32)


def _metadata(seqlens: torch.Tensor, tokens: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    md = torch.zeros(_num_sm_parts(tokens), 8, dtype=torch.int32, device=seqlens.device)
    md[:, 0], md[:, 1] = int(fp8), tokens
    return md, _splits(seqlens)


class FakeFlashMLA:
    """The API functions, bound to one call log."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def get_mla_decoding_metadata(
        self,
        seqlens_k: torch.Tensor,
        num_q_tokens_per_head_k: int,
        h_k: int,
        h_q: int | None = None,
        is_fp8_kvcache: bool = False,
        topk: int | None = None,
        use_legacy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert seqlens_k.dtype == torch.int32 and seqlens_k.dim() == 1, "int32 [B] lengths"
        assert h_k == 1 and topk is None, "dense MQA decoding only"
        assert use_legacy or not is_fp8_kvcache, "dense fp8 decoding exists only on the legacy side"
        self.calls.append(
            {"op": "metadata", "batch": len(seqlens_k), "tokens": num_q_tokens_per_head_k,
             "fp8": is_fp8_kvcache, "lens": seqlens_k.tolist()}
        )  # fmt: skip
        return _metadata(seqlens_k, num_q_tokens_per_head_k, is_fp8_kvcache)

    def flash_mla_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor | None,
        cache_seqlens: torch.Tensor | None,
        head_dim_v: int,
        tile_scheduler_metadata: FlashMLASchedMeta,
        num_splits: None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        is_fp8_kvcache: bool | None = None,
        indices: torch.Tensor | None = None,
        use_legacy: bool = False,
        descale_q: torch.Tensor | None = None,
        descale_k: torch.Tensor | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        meta = tile_scheduler_metadata
        assert isinstance(meta, FlashMLASchedMeta) and num_splits is None
        assert indices is None and use_legacy, "dense decoding needs use_legacy=True"
        assert block_table is not None and cache_seqlens is not None
        fp8 = bool(is_fp8_kvcache)
        _check_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v, fp8, descale_q, descale_k)
        tokens = q.shape[1] * q.shape[2]
        if meta.tile_scheduler_metadata is None:
            assert not fp8, "dense fp8 decoding needs metadata before the first call"
            meta.tile_scheduler_metadata, meta.num_splits = _metadata(cache_seqlens, tokens, False)
        _check_metadata(meta, cache_seqlens, tokens, fp8)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        self.calls.append(_record(q, k_cache, block_table, cache_seqlens, meta, scale, causal,
                                  fp8, descale_q, descale_k))  # fmt: skip
        dq = descale_q.float() if descale_q is not None else 1.0
        dk = descale_k.float() if descale_k is not None else 1.0
        return _attend(q.float() * dq, k_cache, block_table, cache_seqlens, dk, scale, causal)


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    head_dim_v: int,
    fp8: bool,
    descale_q: torch.Tensor | None,
    descale_k: torch.Tensor | None,
) -> None:
    b = q.shape[0]
    assert q.dim() == 4 and q.shape[-1] == HEAD_DIM and head_dim_v == HEAD_DIM_V
    assert k_cache.dim() == 4 and k_cache.shape[1:] == (PAGE, 1, HEAD_DIM), k_cache.shape
    assert block_table.dtype == seqlens.dtype == torch.int32
    assert block_table.dim() == 2 and block_table.shape[0] == b and seqlens.shape == (b,)
    assert q.is_contiguous() and k_cache.is_contiguous()
    if fp8:
        assert q.dtype == k_cache.dtype == E4M3, "dense fp8 takes e4m3 q and KV"
        for d in (descale_q, descale_k):
            assert d is not None and d.dtype == torch.float32 and d.shape == (1,)
    else:
        assert q.dtype == k_cache.dtype == torch.bfloat16, (q.dtype, k_cache.dtype)
        assert descale_q is None and descale_k is None, "descales apply to dense fp8 only"


def _check_metadata(meta: FlashMLASchedMeta, seqlens: torch.Tensor, tokens: int, fp8: bool) -> None:
    md, splits = meta.tile_scheduler_metadata, meta.num_splits
    assert md is not None and splits is not None
    want_md, want_splits = _metadata(seqlens, tokens, fp8)
    assert md.shape == want_md.shape and torch.equal(md, want_md), "metadata of another shape"
    assert torch.equal(splits, want_splits), "stale scheduler metadata: planned for other lengths"


def _record(q, k_cache, table, seqlens, meta, scale, causal, fp8, dq, dk) -> dict[str, Any]:
    return {
        "op": "decode", "q_shape": tuple(q.shape), "q_dtype": q.dtype, "causal": causal,
        "fp8": fp8, "softmax_scale": scale, "kv_ptr": k_cache.data_ptr(),
        "block_table": table.clone(), "seqlens": seqlens.clone(),
        "ptrs": (table.data_ptr(), seqlens.data_ptr(), meta.tile_scheduler_metadata.data_ptr(),
                 meta.num_splits.data_ptr()),
        "descale_q": None if dq is None else dq.clone(),
        "descale_k": None if dk is None else dk.clone(),
    }  # fmt: skip


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    table: torch.Tensor,
    seqlens: torch.Tensor,
    descale_k: torch.Tensor | float,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, s_q, H, 576] float32 -> out [B, s_q, H, 512] bf16, lse [B, H, s_q]."""
    b, s_q, h, _ = q.shape
    out = torch.empty(b, s_q, h, HEAD_DIM_V, dtype=torch.bfloat16)
    lse = torch.empty(b, h, s_q)
    for i, n in enumerate(seqlens.tolist()):
        pages = table[i, : -(-n // PAGE)].long()
        kv = k_cache[pages].reshape(-1, HEAD_DIM)[:n].float() * descale_k  # [n, 576]
        scores = torch.einsum("shd,nd->hsn", q[i], kv) * scale
        if causal:
            masked = torch.arange(n)[None, :] > torch.arange(n - s_q, n)[:, None]
            scores = scores.masked_fill(masked[None], float("-inf"))
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = torch.einsum("hsn,nd->shd", scores.softmax(-1), kv[:, :HEAD_DIM_V]).bfloat16()
    return out, lse


def make_module() -> tuple[types.ModuleType, types.ModuleType]:
    """``flash_mla`` and ``flash_mla.flash_mla_interface`` module objects holding one fake
    (its call log: ``module.calls``)."""
    fake = FakeFlashMLA()
    module = types.ModuleType("flash_mla")
    interface = types.ModuleType("flash_mla.flash_mla_interface")
    interface.FlashMLASchedMeta = FlashMLASchedMeta  # type: ignore[attr-defined]
    for mod in (module, interface):
        mod.get_mla_decoding_metadata = fake.get_mla_decoding_metadata  # type: ignore[attr-defined]
        mod.flash_mla_with_kvcache = fake.flash_mla_with_kvcache  # type: ignore[attr-defined]
    module.__version__ = "1.0.0"  # type: ignore[attr-defined]
    module.has_legacy = lambda: True  # type: ignore[attr-defined]
    module.calls = fake.calls  # type: ignore[attr-defined]
    module.flash_mla_interface = interface  # type: ignore[attr-defined]
    return module, interface


def install(monkeypatch) -> types.ModuleType:
    """Make ``import flash_mla`` return the fake for one test."""
    module, interface = make_module()
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    monkeypatch.setitem(sys.modules, "flash_mla.flash_mla_interface", interface)
    return module


def decode_calls(module: types.ModuleType) -> list[dict[str, Any]]:
    return [c for c in module.calls if c["op"] == "decode"]


def metadata_calls(module: types.ModuleType) -> list[dict[str, Any]]:
    return [c for c in module.calls if c["op"] == "metadata"]
