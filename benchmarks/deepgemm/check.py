"""Self-check of a DeepGEMM build on one GPU: the three SM90 GEMMs dsv3serve uses, each
against a float32 torch reference of the same e4m3 operands, and dsv3serve's own probe.

    python3 benchmarks/deepgemm/check.py OUT.json     # deep_gemm and the repo on PYTHONPATH

Cases (relative Frobenius error of the bf16 result, limit ``RTOL``; each case's first call
includes its nvcc JIT compile, recorded as ``first_call_s``):

- ``fp8_gemm_nt`` at DeepSeek-V3 shapes: M x N x K of the packed q/kv down-projection at
  decode M, o_proj and q_b_proj at prefill M, and M = 50 (scales padded to 16 bytes);
- ``m_grouped_fp8_gemm_nt_contiguous``: 4 experts, 100 / 0 / 300 / 50 rows each padded to 128
  (-1 rows), N x K = 4096 x 7168 (the gate/up projection);
- ``m_grouped_fp8_gemm_nt_masked``: 4 experts of 256 rows, counts 10 / 0 / 256 / 77,
  N x K = 7168 x 2048 (the down projection), padding rows NaN.

Exit status 1 when a case fails or errs, or dsv3serve's probe refuses the module.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsv3serve.kernels import deepgemm
from dsv3serve.kernels.fp8_ref import (
    dequant_per_token_group,
    dequant_weight_block,
    quant_per_token_group,
    quant_weight_block,
)

RTOL = 1e-2
DENSE = [(50, 256, 512), (64, 2112, 7168), (1024, 7168, 16384), (4096, 24576, 1536)]
GROUP_ROWS = [100, 0, 300, 50]
MASKED_COUNTS = [10, 0, 256, 77]


def _operands(m: int, n: int, k: int, groups: int = 0) -> tuple[torch.Tensor, ...]:
    """x e4m3 [M, K] with scales [M, K/128]; weights e4m3 [(G,) N, K] with block scales."""
    xq, xs = quant_per_token_group(torch.randn(m, k, device="cuda"))
    ws = [quant_weight_block(torch.randn(n, k, device="cuda") * 0.02) for _ in range(groups or 1)]
    wq, wsc = torch.stack([w for w, _ in ws]), torch.stack([s for _, s in ws])
    return (xq, xs, wq[0], wsc[0]) if not groups else (xq, xs, wq, wsc)


def _ref(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return dequant_per_token_group(xq, xs) @ dequant_weight_block(wq, ws).t()


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def _case(name: str, shape: list[int], run: Callable[[], float]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        err = run()
    except Exception as e:  # a JIT or launch failure is the result
        return {"case": name, "shape": shape, "ok": False, "error": f"{type(e).__name__}: {e}"}
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    return {"case": name, "shape": shape, "ok": err <= RTOL, "rel_err": err, "first_call_s": first}


def dense(module, m: int, n: int, k: int) -> float:  # noqa: ANN001
    xq, xs, wq, ws = _operands(m, n, k)
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    module.fp8_gemm_nt((xq, xs.t().contiguous().t()), (wq, ws), out)
    return _err(out, _ref(xq, xs, wq, ws))


def contiguous(module, n: int = 4096, k: int = 7168) -> float:  # noqa: ANN001
    padded = [-(-r // 128) * 128 for r in GROUP_ROWS]
    xq, xs, wq, ws = _operands(sum(padded), n, k, len(GROUP_ROWS))
    m_indices = torch.full((sum(padded),), -1, dtype=torch.int32, device="cuda")
    valid, start = [], 0
    for g, (rows, size) in enumerate(zip(GROUP_ROWS, padded, strict=True)):
        m_indices[start : start + rows] = g
        valid.append((g, start, start + rows))
        start += size
    out = torch.empty((sum(padded), n), dtype=torch.bfloat16, device="cuda")
    module.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), out, m_indices)
    ys = [out[a:b] for _, a, b in valid if b > a]
    refs = [_ref(xq[a:b], xs[a:b], wq[g], ws[g]) for g, a, b in valid if b > a]
    return _err(torch.cat(ys), torch.cat(refs))


def masked(module, n: int = 7168, k: int = 2048, max_m: int = 256) -> float:  # noqa: ANN001
    g = len(MASKED_COUNTS)
    xq, xs, wq, ws = _operands(g * max_m, n, k, g)
    xq, xs = xq.view(g, max_m, k), xs.view(g, max_m, -1).clone()
    for e, c in enumerate(MASKED_COUNTS):
        xs[e, c:] = float("nan")  # padding rows: must not reach a valid row
    counts = torch.tensor(MASKED_COUNTS, dtype=torch.int32, device="cuda")
    out = torch.empty((g, max_m, n), dtype=torch.bfloat16, device="cuda")
    module.m_grouped_fp8_gemm_nt_masked((xq, xs), (wq, ws), out, counts, 64)
    ys = [out[e, :c] for e, c in enumerate(MASKED_COUNTS) if c]
    refs = [_ref(xq[e, :c], xs[e, :c], wq[e], ws[e]) for e, c in enumerate(MASKED_COUNTS) if c]
    return _err(torch.cat(ys), torch.cat(refs))


def main(out_path: str) -> int:
    torch.manual_seed(0)
    start = time.perf_counter()
    import deep_gemm  # type: ignore[import-not-found]

    result: dict[str, Any] = {
        "import_s": time.perf_counter() - start,
        "deep_gemm": getattr(deep_gemm, "__version__", None),
        "module_file": deep_gemm.__file__,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cases": [
            _case("fp8_gemm_nt", [m, n, k], lambda m=m, n=n, k=k: dense(deep_gemm, m, n, k))
            for m, n, k in DENSE
        ],  # fmt: skip
    }
    result["cases"].append(_case("m_grouped_contiguous", GROUP_ROWS, lambda: contiguous(deep_gemm)))
    result["cases"].append(_case("m_grouped_masked", MASKED_COUNTS, lambda: masked(deep_gemm)))
    status = deepgemm.deepgemm_status("cuda", 0)
    result["dsv3serve_probe"] = {"usable": status.usable, "reason": status.reason}
    result["ok"] = status.usable and all(c["ok"] for c in result["cases"])
    Path(out_path).write_text(json.dumps(result, indent=1))
    for c in result["cases"]:
        print(json.dumps(c))
    print(f"dsv3serve probe: {status.reason}; all ok: {result['ok']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "deepgemm_check.json"))
