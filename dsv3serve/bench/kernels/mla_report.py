"""The table ``bench kernels --only mla`` prints from its JSON section
(:func:`dsv3serve.bench.kernels.mla.bench_mla`)."""

from __future__ import annotations

from dsv3serve.bench.kernels.mla import TARGET_PCT, add_flashinfer_ratios


def print_mla_table(ceil: dict, mla: dict) -> None:
    """One line per row, grouped by (context, batch); ``xfi``: flashinfer's (page indices)
    time at the same point over the row's (above 1: faster than flashinfer)."""
    print(
        f"MLA decode (flashinfer {mla['flashinfer']}, Triton, flash_mla {mla.get('flash_mla')}): "
        f"128 heads, 512+64, page "
        f"{mla['page_size']}; copy ceiling {ceil['copy_TBps']:.2f} TB/s; "
        f"target >= {TARGET_PCT:.0f}% at batch >= 32"
    )
    add_flashinfer_ratios(mla["rows"])
    head = f"{'kernel':>20} {'kv':>4} {'batch':>5} {'context':>7} {'index':>5}"
    print(f"{head} {'us':>9} {'TB/s':>6} {'%copy':>6} {'TFLOP/s':>7} {'xfi':>5}  config")
    for r in mla["rows"]:
        ratio = f"{r['x_flashinfer']:5.2f}" if r.get("x_flashinfer") else f"{'-':>5}"
        print(
            f"{r['kernel']:>20} {r['kv_dtype']:>4} {r['batch']:>5} {r['context']:>7} "
            f"{r['index']:>5} {r['us']:>9.1f} {r['TBps']:>6.2f} {r['pct_copy_bw']:>6.1f} "
            f"{r.get('TFLOPs', 0.0):>7.0f} {ratio}  {_config_text(r.get('config'))}"
        )


def _config_text(cfg: dict | None) -> str:
    if not cfg:
        return ""
    keys = ("block_h", "block_n", "num_warps", "num_stages", "dv_split", "prefetch")
    return " ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)
