"""Probe: where the FP8 tensor-core MLA decode kernel's time goes, and whether a
token-major copy of V would fix it (issue 34 item 3: "find out why").

    python benchmarks/mla_fp8_layout_probe.py OUT.json

``kernels/mla_decode_fp8.py`` feeds both products from the e4m3 pool rows. For QK^T the rows
are K-major as stored; for PV the FP8 MMA needs the tile token-major, so Triton transposes
each [BLOCK_N, DV] tile through registers into shared memory. This probe times, at
DeepSeek-V3's shapes (128 heads, 512 + 64, page 64, one KV split), in one run:

- flashinfer fa3 on a bf16 pool (the issue's bar) and the production FP8 kernel;
- a probe kernel built from the production kernel's own pieces (``_tile_rows``,
  ``_load_tile``, ``_scores``, ``_softmax_pv``) in four modes: ``full`` (the production
  loop, PV tile from the rows), ``vt`` (the PV tile from a token-major copy of c_kv, pages
  of [512, PAGE], so it reaches shared memory as loaded), ``qk`` (scores and softmax only,
  no PV) and ``pv`` (PV from the rows, no QK^T: constant scores);
- each over block_n 32 / 64, dv_split 1 / 2 and 4 / 8 warps.

The ``full`` and ``vt`` outputs are checked against the production kernel's (relative
error printed); ``qk`` / ``pv`` outputs are not attention and are only timed. Nothing here
is used by the engine: a layout change of the pool would come after it.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from mla_fp8_flashinfer_probe import _rel, _time  # the same event timing (run from benchmarks/)

from dsv3serve.kernels.mla_decode import LOG2E, MLADecodeMeta
from dsv3serve.kernels.mla_decode_fp8 import (
    FP8MLAConfig,
    _load_tile,
    _rope_offsets,
    _scores,
    _softmax_pv,
    _tile_rows,
    decode_flops,
    mla_decode_fp8,
    quantize_q,
)

H, R, P, PAGE = 128, 512, 64, 64
SM_SCALE = 192**-0.5
POINTS = [(64, 4096), (128, 4096)]
MODES = {"full": 0, "vt": 1, "qk": 2, "pv": 3}


@dataclass(frozen=True)
class ProbeConfig:
    block_n: int
    dv_split: int
    num_warps: int


CONFIGS = [ProbeConfig(n, s, w) for n, s, w in itertools.product((32, 64), (1, 2), (4, 8))]


@triton.jit
def _qk_only(qk, m_i, l_i):
    """Online-softmax statistics of a tile, no PV (mode ``qk``)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    return m_new, l_i * tl.exp2(m_i - m_new) + tl.sum(p, 1)


@triton.jit
def _probe_kernel(
    q8_ptr, qs_ptr, kv_ptr, ks_ptr, vt_ptr, idx_ptr, pstart_ptr, kvlen_ptr, out_ptr,
    sm_scale_log2, num_heads, s_kv, s_o_t, s_o_h,
    RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, DV_SPLIT: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_H heads of token t, output columns of chunk pid0 % DV_SPLIT, the
    whole KV in one split. MODE 0 full, 1 PV tile from ``vt`` [pages, RANK, PAGE_SIZE],
    2 QK^T only, 3 PV only."""
    pid0, t = tl.program_id(0), tl.program_id(1)
    heads = (pid0 // DV_SPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
    DV: tl.constexpr = RANK // DV_SPLIT
    hmask = heads < num_heads
    offs_p, pmask = _rope_offsets(ROPE)
    offs_v = (pid0 % DV_SPLIT) * DV + tl.arange(0, DV)
    kv_len = tl.load(kvlen_ptr + t)
    page0 = tl.load(pstart_ptr + t)
    row = (t * num_heads + heads).to(tl.int64)
    q8_row = q8_ptr + row[:, None] * (RANK + ROPE)
    qn = tl.load(q8_row + tl.arange(0, RANK)[None, :], mask=hmask[:, None], other=0.0)
    qp = tl.load(q8_row + RANK + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    q_scale = tl.load(qs_ptr + row, mask=hmask, other=0.0) * sm_scale_log2
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_scale = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for n0 in range(0, kv_len, BLOCK_N):
        rows, nmask = _tile_rows(idx_ptr, page0, n0, kv_len, PAGE_SIZE, BLOCK_N)
        if MODE != 2:  # the PV operand first, so that it lands while QK^T runs
            if MODE == 1:  # a tile lies in one page (BLOCK_N divides PAGE_SIZE)
                page = tl.load(idx_ptr + page0 + n0 // PAGE_SIZE).to(tl.int64)
                slot = tl.multiple_of(n0 % PAGE_SIZE, BLOCK_N) + tl.arange(0, BLOCK_N)
                v_ptrs = vt_ptr + page * (RANK * PAGE_SIZE) + offs_v[:, None] * PAGE_SIZE
                v_t = tl.load(v_ptrs + slot[None, :], mask=nmask[None, :], other=0.0)
            else:
                v_ptrs = kv_ptr + rows[None, :] * s_kv + offs_v[:, None]
                v_t = tl.load(v_ptrs, mask=nmask[None, :], other=0.0)
        if MODE == 3:
            ks = tl.load(ks_ptr + rows, mask=nmask, other=0.0)
            qk = tl.where(nmask[None, :], tl.zeros([BLOCK_H, BLOCK_N], tl.float32), float("-inf"))
        else:
            ckv, kpe, ks = _load_tile(kv_ptr, ks_ptr, rows, nmask, s_kv, RANK, ROPE)
            qk = _scores(qn, qp, q_scale, ckv, kpe, ks, nmask)
        if MODE == 2:
            m_i, l_i = _qk_only(qk, m_i, l_i)
        else:
            m_i, l_i, acc, acc_scale = _softmax_pv(qk, ks, tl.trans(v_t), m_i, l_i, acc, acc_scale)
    out = acc * (acc_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    o_ptrs = out_ptr + t * s_o_t + heads[:, None] * s_o_h + offs_v[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


def probe_call(
    q8: torch.Tensor, qs: torch.Tensor, kv: torch.Tensor, ks: torch.Tensor, vt: torch.Tensor,
    meta: MLADecodeMeta, out: torch.Tensor, cfg: ProbeConfig, mode: str,
) -> None:  # fmt: skip
    """Launch the probe kernel (q already quantised: ``quantize_q``)."""
    t = q8.shape[0]
    rows = kv.view(-1, kv.shape[-1])
    _probe_kernel[(2 * cfg.dv_split, t)](
        q8, qs, rows, ks, vt, meta.kv_indices, meta.page_start, meta.kv_len, out,
        SM_SCALE * LOG2E, H, rows.stride(0), out.stride(0), out.stride(1),
        RANK=R, ROPE=P, PAGE_SIZE=PAGE, BLOCK_H=64, BLOCK_N=cfg.block_n,
        DV_SPLIT=cfg.dv_split, MODE=MODES[mode], num_warps=cfg.num_warps, num_stages=2,
    )  # fmt: skip


def _inputs(bs: int, ctx: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(bs + ctx)
    pages = bs * ctx // PAGE
    bf16 = torch.randn(pages, PAGE, R + P, generator=gen, device="cuda").to(torch.bfloat16)
    ks = (bf16.float().abs().amax(-1) / 448.0).clamp_min(1e-12)
    kv8 = (bf16.float() / ks[..., None]).to(torch.float8_e4m3fn)
    vt = kv8[..., :R].transpose(1, 2).contiguous()  # [pages, R, PAGE]
    table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)
    per = ctx // PAGE
    meta = MLADecodeMeta(
        kv_indices=table,
        page_start=torch.arange(bs, dtype=torch.int32, device="cuda") * per,
        kv_len=torch.full((bs,), ctx, dtype=torch.int32, device="cuda"),
        page_size=PAGE,
        num_splits=1,
    )
    q_nope = torch.randn(bs, H, R, generator=gen, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(bs, H, P, generator=gen, device="cuda").to(torch.bfloat16)
    return {"bf16": bf16, "kv8": kv8, "ks": ks, "vt": vt, "table": table, "meta": meta,
            "q_nope": q_nope, "q_pe": q_pe}  # fmt: skip


def _flashinfer_us(fi: Any, x: dict[str, Any], bs: int, ctx: int) -> float:
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = fi.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    qo = torch.arange(bs + 1, dtype=torch.int32)
    indptr = torch.arange(bs + 1, dtype=torch.int32) * (ctx // PAGE)
    lens = torch.full((bs,), ctx, dtype=torch.int32)
    w.plan(qo, indptr, x["table"].cpu(), lens, H, R, P, PAGE, False, SM_SCALE,
           torch.bfloat16, torch.bfloat16)  # fmt: skip
    rows = x["bf16"]
    return _time(lambda: w.run(x["q_nope"], x["q_pe"], rows[..., :R], rows[..., R:]))


def point(fi: Any, bs: int, ctx: int) -> list[dict[str, Any]]:
    """Every kernel and probe mode at one (batch, context) point."""
    x = _inputs(bs, ctx)
    flops = decode_flops(bs * ctx, H, R, P)
    base = {"batch": bs, "context": ctx}
    rows = [base | {"kernel": "flashinfer-bf16", "us": _flashinfer_us(fi, x, bs, ctx)}]
    ref = mla_decode_fp8(x["q_nope"], x["q_pe"], x["kv8"], x["ks"], x["meta"], SM_SCALE)
    prod_us = _time(
        lambda: mla_decode_fp8(x["q_nope"], x["q_pe"], x["kv8"], x["ks"], x["meta"], SM_SCALE)
    )
    prod = {"kernel": "fp8mma-production", "config": vars(FP8MLAConfig()), "us": prod_us}
    rows.append(base | prod)
    q8, qs = quantize_q(x["q_nope"], x["q_pe"])
    for cfg, mode in itertools.product(CONFIGS, MODES):
        out = torch.empty_like(x["q_nope"])
        args = (q8, qs, x["kv8"], x["ks"], x["vt"], x["meta"], out, cfg, mode)
        row = base | {"kernel": f"probe-{mode}", "config": vars(cfg)}
        try:
            probe_call(*args)
            row["us"] = _time(lambda args=args: probe_call(*args))
            if mode in ("full", "vt"):
                row["rel_err_vs_production"] = _rel(out, ref)
        except Exception as err:  # noqa: BLE001 - a probe records what failed
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    fi_us = rows[0]["us"]
    for r in rows:
        if "us" in r:
            r["tflops"] = flops / r["us"] / 1e6
            r["x_flashinfer"] = fi_us / r["us"]
    return rows


def _line(r: dict[str, Any]) -> str:
    cfg = r.get("config") or {}
    c = f"n{cfg.get('block_n')} s{cfg.get('dv_split')} w{cfg.get('num_warps')}" if cfg else ""
    if "us" not in r:
        return f"{r['batch']:>4} {r['kernel']:<18} {c:<12} {r.get('error', '')}"
    err = r.get("rel_err_vs_production")
    return (
        f"{r['batch']:>4} {r['kernel']:<18} {c:<12} {r['us']:9.1f} us {r['tflops']:6.0f} TFLOP/s "
        f"x{r['x_flashinfer']:.2f}" + (f"  err {err:.4f}" if err is not None else "")
    )


def main(out: str) -> None:
    import flashinfer as fi

    rows: list[dict[str, Any]] = []
    print("batch kernel             config       time, TFLOP/s, flashinfer's time / this")
    for bs, ctx in POINTS:
        for r in point(fi, bs, ctx):
            print(_line(r))
            rows.append(r)
        torch.cuda.empty_cache()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "flashinfer": getattr(fi, "__version__", "?")}  # fmt: skip
    with open(out, "w") as f:
        json.dump({"environment": env, "sm_scale": SM_SCALE, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
