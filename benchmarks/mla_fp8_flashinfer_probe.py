"""Probe: flashinfer's FP8-KV MLA decode (Hopper, fa3) against its bf16 decode.

    python benchmarks/mla_fp8_flashinfer_probe.py OUT.json

flashinfer 0.6.18 decodes an e4m3 latent cache with bf16 queries when given c_kv scales
per token per 128 channels (``ckv_scale_arr``) and one k_pe scale (``kpe_scale``). Our
fp8 pool keeps one scale per token over all 576 values, so this measures, before any pool
change, whether that layout would pay: DeepSeek-V3 shapes (128 heads, 512 + 64, page 64,
rows of 576 values as the pool stores them), pages shuffled, times from CUDA events over
back-to-back calls, and the error of each output against float32 attention over the
values each cache holds (and, for fp8, over the bf16 values it was quantised from).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import torch

H, R, P, PAGE = 128, 512, 64, 64
SM_SCALE = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2
FP8_MAX = 448.0
POINTS = [(64, 4096), (128, 4096), (32, 1024), (1, 1024)]


def _caches(pages: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """bf16 rows, e4m3 rows of the same values with their scales, and the dequantised."""
    dev = "cuda"
    rows = torch.randn(pages, PAGE, R + P, generator=gen, device=dev).to(torch.bfloat16)
    ckv = rows[..., :R].float().view(pages, PAGE, R // 128, 128)
    ckv_s = (ckv.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)  # [pages, PAGE, 4]
    kpe = rows[..., R:].float()
    kpe_s = float(kpe.abs().amax()) / FP8_MAX
    rows8 = torch.empty(pages, PAGE, R + P, dtype=torch.float8_e4m3fn, device=dev)
    rows8[..., :R] = (ckv / ckv_s[..., None]).view(pages, PAGE, R).to(torch.float8_e4m3fn)
    rows8[..., R:] = (kpe / kpe_s).to(torch.float8_e4m3fn)
    deq = torch.empty_like(rows, dtype=torch.float32)
    held = rows8[..., :R].float().view(pages, PAGE, R // 128, 128)
    deq[..., :R] = (held * ckv_s[..., None]).view(pages, PAGE, R)
    deq[..., R:] = rows8[..., R:].float() * kpe_s
    return {"bf16": rows, "fp8": rows8, "ckv_s": ckv_s.contiguous(), "kpe_s": kpe_s, "deq": deq}


def _reference(q_nope, q_pe, rows, page_table, bs, ctx) -> torch.Tensor:  # noqa: ANN001
    """float32 absorbed MLA of each sequence over its pages (``rows`` float32)."""
    out = []
    per = ctx // PAGE
    for b in range(bs):
        kv = rows[page_table[b * per : (b + 1) * per]].reshape(ctx, R + P)
        s = (q_nope[b].float() @ kv[:, :R].T + q_pe[b].float() @ kv[:, R:].T) * SM_SCALE
        out.append(torch.softmax(s, -1) @ kv[:, :R])
    return torch.stack(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _time(fn: Any, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def point(fi: Any, bs: int, ctx: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(bs * 7 + ctx)
    pages = bs * ctx // PAGE
    c = _caches(pages, gen)
    table = torch.randperm(pages, generator=gen, device="cuda").to(torch.int32)
    q_nope = torch.randn(bs, H, R, generator=gen, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(bs, H, P, generator=gen, device="cuda").to(torch.bfloat16)
    qo = torch.arange(bs + 1, dtype=torch.int32)
    kv_indptr = torch.arange(bs + 1, dtype=torch.int32) * (ctx // PAGE)
    lens = torch.full((bs,), ctx, dtype=torch.int32)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    row: dict[str, Any] = {"batch": bs, "context": ctx}
    outs = {}
    for kind in ("bf16", "fp8"):
        w = fi.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        dtype = torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn
        w.plan(qo, kv_indptr, table.cpu(), lens, H, R, P, PAGE, False, SM_SCALE,
               torch.bfloat16, dtype)  # fmt: skip
        rows = c[kind]
        ckv, kpe = rows[..., :R], rows[..., R:]
        extra = {} if kind == "bf16" else {"ckv_scale_arr": c["ckv_s"], "kpe_scale": c["kpe_s"]}

        def call(w=w, ckv=ckv, kpe=kpe, extra=extra) -> torch.Tensor:  # noqa: ANN001
            return w.run(q_nope, q_pe, ckv, kpe, **extra)

        try:
            outs[kind] = call()
            row[f"{kind}_us"] = _time(call)
        except Exception as err:  # noqa: BLE001 - a probe records what failed
            row[f"{kind}_error"] = f"{type(err).__name__}: {err}"[:300]
    n = min(bs, 4)
    if "bf16" in outs:
        ref = _reference(q_nope, q_pe, c["bf16"].float(), table.long(), n, ctx)
        row["bf16_rel_err"] = _rel(outs["bf16"][:n], ref)
    if "fp8" in outs:
        ref_deq = _reference(q_nope, q_pe, c["deq"], table.long(), n, ctx)
        ref_bf16 = _reference(q_nope, q_pe, c["bf16"].float(), table.long(), n, ctx)
        row["fp8_rel_err_vs_held"] = _rel(outs["fp8"][:n], ref_deq)
        row["fp8_rel_err_vs_bf16"] = _rel(outs["fp8"][:n], ref_bf16)
    if "bf16_us" in row and "fp8_us" in row:
        row["fp8_over_bf16"] = row["fp8_us"] / row["bf16_us"]
    return row


def main(out: str) -> None:
    import flashinfer as fi

    rows = []
    for bs, ctx in POINTS:
        r = point(fi, bs, ctx)
        rows.append(r)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
        torch.cuda.empty_cache()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "flashinfer": getattr(fi, "__version__", "?")}  # fmt: skip
    with open(out, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
