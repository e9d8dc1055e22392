"""FakeFlashInferCPU: flashinfer 0.6.18's three attention entry points in plain torch.

What cannot run here (flashinfer needs a CUDA GPU) is imitated from its source: the same
signatures, the int32 index contract, paged MLA addressing (``kv_indices[kv_indptr[b] +
p // page_size]``, row ``p % page_size``), the causal mask aligned bottom-right, LSE in
base 2, O = 0 / LSE = -inf for an empty KV range, the CUDA-graph buffer copies of
``plan()``, and ``merge_state_in_place``'s limit of 1024 threads per block. It lets the
backend's planning and merging be checked on the CPU; the GPU tests check the real one.
"""

from __future__ import annotations

import math
import sys
import types

import torch

LN2 = math.log(2.0)


def _check_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        assert t.dtype == torch.int32, f"{name}: flashinfer index arrays are int32, got {t.dtype}"


def _host(t: torch.Tensor) -> list[int]:
    return t.to("cpu").tolist()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """q [n, H, d], k [s, H or 1, d], v [s, H or 1, dv] -> o [n, H, dv] f32, lse2 [n, H]."""
    n, s = q.shape[0], k.shape[0]
    if s == 0:
        h = q.shape[1]
        return torch.zeros(n, h, v.shape[-1]), torch.full((n, h), float("-inf"))
    scores = torch.einsum("nhd,shd->hns", q.float(), k.float().expand(s, q.shape[1], -1)) * scale
    if causal:
        masked = torch.arange(s)[None, :] > torch.arange(s - n, s)[:, None]
        scores = scores.masked_fill(masked[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    out = torch.einsum("hns,shd->nhd", scores.softmax(-1), v.float().expand(s, q.shape[1], -1))
    return out, (lse / LN2).t()


class BatchMLAPagedAttentionWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_len_arr: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        self._bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        page_size: int,
        causal: bool,
        sm_scale: float,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        use_profiler: bool = False,
    ) -> None:
        _check_int32(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices)
        _check_int32(kv_len_arr=kv_len_arr)
        assert len(kv_len_arr) == len(qo_indptr) - 1 == len(kv_indptr) - 1
        if self._use_cuda_graph:
            qo_buf, kv_buf, idx_buf, len_buf = self._bufs
            qo_buf.copy_(qo_indptr)  # fails unless the batch size is the buffers'
            kv_buf.copy_(kv_indptr)
            idx_buf[: len(kv_indices)].copy_(kv_indices)
            len_buf.copy_(kv_len_arr)
            self._indices = idx_buf
        else:
            self._indices = kv_indices.to(self.device)
        self._qo, self._kv, self._lens = _host(qo_indptr), _host(kv_indptr), _host(kv_len_arr)
        self._page_size, self._causal, self._scale = page_size, causal, sm_scale
        self._dims = (num_heads, head_dim_ckv, head_dim_kpe)
        self._dtypes = (q_data_type, kv_data_type)

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        assert (q_nope.dtype, ckv_cache.dtype) == self._dtypes, "dtype differs from the plan"
        assert (q_nope.shape[1], ckv_cache.shape[-1], kpe_cache.shape[-1]) == self._dims
        assert ckv_cache.shape[1] == self._page_size, "cache page size differs from the plan"
        for t in (q_nope, q_pe, ckv_cache, kpe_cache):
            assert t.stride(-1) == 1, "the kernel needs a contiguous last dimension"
        out = torch.empty_like(q_nope) if out is None else out
        lse = torch.empty(q_nope.shape[:2]) if lse is None else lse
        q = torch.cat([q_nope, q_pe], dim=-1)
        for b in range(len(self._lens)):
            pages = self._indices[self._kv[b] : self._kv[b + 1]].long()
            rows = torch.cat([ckv_cache[pages], kpe_cache[pages]], -1).flatten(0, 1)
            rows = rows[: self._lens[b], None]  # [s, 1, 576]
            qs = slice(self._qo[b], self._qo[b + 1])
            o, s = _attend(q[qs], rows, rows[..., : ckv_cache.shape[-1]], self._scale, self._causal)
            out[qs], lse[qs] = o.to(out.dtype), s
        return (out, lse) if return_lse else out


class BatchPrefillWithRaggedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **_) -> None:
        assert kv_layout == "NHD"

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: torch.dtype | str = "float16",
        kv_data_type: torch.dtype | str | None = None,
    ) -> None:
        _check_int32(qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        assert num_qo_heads == num_kv_heads, "the fake does MHA only"
        self._qo, self._kv = _host(qo_indptr), _host(kv_indptr)
        self._causal = causal
        self._scale = sm_scale if sm_scale is not None else head_dim_qk**-0.5
        self._dims = (num_qo_heads, head_dim_qk, head_dim_vo or head_dim_qk)
        self._dtype = q_data_type

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kw):
        out, lse, return_lse = kw.get("out"), kw.get("lse"), kw.get("return_lse", False)
        assert q.shape[0] == self._qo[-1] and k.shape[0] == v.shape[0] == self._kv[-1]
        assert (q.shape[1], q.shape[2], v.shape[2]) == self._dims and q.dtype == self._dtype
        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype) if out is None else out
        lse = torch.empty(q.shape[:2]) if lse is None else lse
        for b in range(len(self._qo) - 1):
            qs, ks = slice(self._qo[b], self._qo[b + 1]), slice(self._kv[b], self._kv[b + 1])
            o, s = _attend(q[qs], k[ks], v[ks], self._scale, self._causal)
            out[qs], lse[qs] = o.to(out.dtype), s
        return (out, lse) if return_lse else out


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    for t in (v, s, v_other, s_other):
        assert t.is_contiguous(), "merge_state_in_place needs contiguous tensors"
    assert v.dim() == 3 and v.shape == v_other.shape and s.shape == s_other.shape == v.shape[:2]
    vec = max(16 // v.element_size(), v.shape[2] // 32)
    threads = (v.shape[2] // vec) * v.shape[1]
    assert threads <= 1024, f"kernel launch of {threads} threads per block fails on CUDA"
    s_max = torch.maximum(s, s_other)
    a, b = torch.exp2(s - s_max), torch.exp2(s_other - s_max)
    merged = (a[..., None] * v.float() + b[..., None] * v_other.float()) / (a + b)[..., None]
    merged_s = torch.log2(a + b) + s_max
    rows = slice(None) if mask is None else mask.bool()
    assert mask is None or mask.shape == (v.shape[0],)
    v[rows] = merged[rows].to(v.dtype)
    s[rows] = merged_s[rows]


def make_module() -> types.ModuleType:
    """A ``flashinfer`` module object holding the fakes (install it in ``sys.modules``)."""
    module = types.ModuleType("flashinfer")
    module.__version__ = "0.6.18.post1"  # type: ignore[attr-defined]
    module.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper  # type: ignore[attr-defined]
    module.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper  # type: ignore[attr-defined]
    module.merge_state_in_place = merge_state_in_place  # type: ignore[attr-defined]
    return module


def install(monkeypatch) -> types.ModuleType:
    """Make ``import flashinfer`` return the fake for one test."""
    module = make_module()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module
