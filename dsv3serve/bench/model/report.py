"""The model bench's environment record and its printed tables."""

from __future__ import annotations

import datetime
import platform
from importlib import metadata
from typing import Any

import torch


def _version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` found (a package's wheel names vary)."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment(device: torch.device) -> dict[str, Any]:
    """Device name, library versions (None where not installed) and the date (UTC)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, sms = props.name, props.multi_processor_count
    else:
        name, sms = platform.processor() or platform.machine(), None
    return {
        "device": name,
        "sms": sms,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton", "pytorch-triton"),
        "flashinfer": _version("flashinfer-python", "flashinfer"),
        "flash_mla": _version("sgl-flash-mla"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_header(result: dict[str, Any]) -> None:
    env, cfg, ceil = result["environment"], result["config"], result["ceilings"]
    print(f"device: {env['device']}  torch {env['torch']}  triton {env['triton']}  "
          f"flashinfer {env['flashinfer']}  {env['date']}")  # fmt: skip
    gemm = (
        f", bf16 {ceil['bf16_gemm_TFLOPs']:.0f} TFLOP/s, fp8 {ceil['fp8_gemm_TFLOPs']:.0f} TFLOP/s"
        if "fp8_gemm_TFLOPs" in ceil
        else " (host copy; no GEMM peaks on CPU)"
    )
    print(f"ceilings (this run): copy {ceil['copy_TBps']:.3f} TB/s{gemm}")
    print(
        f"model: preset {cfg['preset']}, {cfg['num_dense_layers']} dense + "
        f"{cfg['num_moe_layers']} MoE{' + NextN' if cfg['mtp'] else ''} layers; attention "
        f"{cfg['attention_backend']}, moe {cfg['moe_backend']}, kv {cfg['kv_cache_dtype']}, "
        f"page {cfg['page_size']}; weights {result['memory']['weights_GB']:.2f} GB, "
        f"kv {result['memory']['kv_cache_GB']:.2f} GB"
    )
    print(f"timing: {cfg['timing']}")
    print(f"projection: {cfg['projection']}")
    if "projection_graph" in cfg:
        print(f"projection (graphs): {cfg['projection_graph']}")


def _print_errors(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Print the failed rows; return the others."""
    for r in rows:
        if "error" in r:
            point = {k: v for k, v in r.items() if k != "error"}
            print(f"  failed {point}: {r['error']}")
    return [r for r in rows if "error" not in r]


def print_prefill(rows: list[dict[str, Any]]) -> None:
    print("\nprefill (one sequence)")
    print(f"{'len':>6} {'ms':>9} {'tok/s':>10} | {'61-layer ms':>11} {'tok/s':>10}")
    for r in _print_errors(rows):
        p = r["projected_61"]
        print(
            f"{r['input_len']:>6} {r['ms']:>9.2f} {r['tokens_per_s']:>10.0f} | "
            f"{p['ms']:>11.1f} {p['tokens_per_s']:>10.0f}"
        )


def print_decode(rows: list[dict[str, Any]]) -> None:
    print("\ndecode step (ratio = measured / roofline at the copy bandwidth)")
    print(
        f"{'bs':>4} {'ctx':>6} {'ms':>8} {'tok/s':>9} {'ratio':>6} | {'dense ms':>8} "
        f"{'ratio':>6} {'MoE ms':>8} {'ratio':>6} {'head ms':>8} | {'61-layer ms':>11} "
        f"{'tok/s':>8} {'ratio':>6}"
    )
    for r in _print_errors(rows):
        dense = next(x for x in r["layers"] if x["kind"] == "dense")
        moe = [x for x in r["layers"] if x["kind"] == "moe"]
        moe_ms = sum(x["ms"] for x in moe) / len(moe)
        moe_ratio = sum(x["ratio"] for x in moe) / len(moe)
        p = r["projected_61"]
        print(
            f"{r['batch_size']:>4} {r['context']:>6} {r['ms']:>8.3f} {r['tokens_per_s']:>9.0f} "
            f"{r['ratio']:>6.2f} | {dense['ms']:>8.3f} {dense['ratio']:>6.2f} {moe_ms:>8.3f} "
            f"{moe_ratio:>6.2f} {r['head']['ms']:>8.3f} | {p['ms']:>11.2f} "
            f"{p['tokens_per_s']:>8.0f} {p['ratio']:>6.2f}"
        )


def print_decode_graphs(rows: list[dict[str, Any]]) -> None:
    """Eager vs CUDA-graph decode steps of the bench model (as built, not projected)."""
    rows = [r for r in rows if "error" not in r and r.get("graph_ms") is not None]
    if not rows:
        print("\ndecode step through CUDA graphs: none (no graphs for these batch sizes)")
        return
    print("\ndecode step, eager vs CUDA graph (the bench model's layers; ratio to its roofline)")
    print(f"{'bs':>4} {'ctx':>6} {'eager ms':>9} {'graph ms':>9} {'ratio':>6} {'tok/s':>9}")
    for r in rows:
        g = r["graph_ms"]
        print(
            f"{r['batch_size']:>4} {r['context']:>6} {r['ms']:>9.3f} {g:>9.3f} "
            f"{r['graph_ratio']:>6.2f} {r['batch_size'] / g * 1e3:>9.0f}"
        )


def print_mtp(mtp: dict[str, Any]) -> None:
    print(f"\nMTP step costs at context {mtp['context']} (measured; 61-layer projection)")
    steps = mtp["num_steps"]
    head = " ".join(f"{'verify k=' + str(k):>11}" for k in steps)
    print(f"{'bs':>4} {'decode ms':>10} {'draft ms':>9} {head} | {'61: decode':>10} "
          + " ".join(f"{'verify k=' + str(k):>11}" for k in steps))  # fmt: skip
    for r in _print_errors(mtp["rows"]):
        p = r["projected_61"]
        verify = " ".join(f"{r['verify_ms'][str(k)]:>11.3f}" for k in steps)
        verify_p = " ".join(f"{p['verify_ms'][str(k)]:>11.2f}" for k in steps)
        print(
            f"{r['batch_size']:>4} {r['decode_ms']:>10.3f} {r['draft_ms']:>9.3f} {verify} | "
            f"{p['decode_ms']:>10.2f} {verify_p}"
        )
    for key, title in (("speedup_projected_61", "61-layer projection"), ("speedup", "measured")):
        _print_speedup(mtp[key], mtp["accept_lengths"], title)
    print_mtp_graphs(mtp)


def print_mtp_graphs(mtp: dict[str, Any]) -> None:
    """Graphed MTP steps beside the eager ones, and the speedups from graphed times."""
    rows = [r for r in mtp["rows"] if "error" not in r and r.get("graph")]
    if not rows:
        print("\nMTP steps through CUDA graphs: none (no decode graphs for these batch sizes)")
        return
    steps = mtp["num_steps"]
    print(f"\nMTP steps through CUDA graphs at context {mtp['context']} (eager in brackets)")
    heads = " ".join(f"{'chain k=' + str(k):>9} {'verify k=' + str(k):>17}" for k in steps)
    print(f"{'bs':>4} {'decode ms':>17} {'draft ms':>17} {heads}")
    for r in rows:
        g = r["graph"]
        cells = " ".join(
            f"{_fmt(g['chain_ms'].get(str(k)), '9.3f'):>9} "
            f"{g['verify_ms'][str(k)]:>8.3f} ({r['verify_ms'][str(k)]:>6.3f})"
            for k in steps
        )
        print(
            f"{r['batch_size']:>4} {g['decode_ms']:>8.3f} ({r['decode_ms']:>6.3f}) "
            f"{g['draft_ms']:>8.3f} ({r['draft_ms']:>6.3f}) {cells}"
        )
    title = "CUDA graphs: chain + extend + verify vs graphed decode"
    _print_speedup(mtp["speedup_graph"], mtp["accept_lengths"], title)
    print_graph_projection(mtp, rows)


def print_graph_projection(mtp: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Graphed single-layer times, the graphed steps at 61 layers and their speedups."""
    rows = [r for r in rows if r["graph"].get("layer_ms") or r["graph"].get("layer_error")]
    if not rows:
        return
    steps = mtp["num_steps"]
    widths = [1, *(k + 1 for k in steps)]
    print("\none layer captured alone, ms per replay (w = new tokens per sequence; "
          "61: graphed steps projected to 3 dense + 58 MoE layers)")  # fmt: skip
    cells = " ".join(f"{kind + ' w=' + str(w):>11}" for kind in ("dense", "moe") for w in widths)
    verify = " ".join(f"{'verify k=' + str(k):>11}" for k in steps)
    print(f"{'bs':>4} {cells} | {'61: decode':>10} {verify}")
    for r in rows:
        g = r["graph"]
        if g.get("layer_ms") is None:
            print(f"{r['batch_size']:>4} failed: {g['layer_error']}")
            continue
        t, p = g["layer_ms"], g["projected_61"]
        cells = " ".join(f"{t[kind][str(w)]:>11.3f}" for kind in ("dense", "moe") for w in widths)
        verify = " ".join(f"{p['verify_ms'][str(k)]:>11.2f}" for k in steps)
        print(f"{r['batch_size']:>4} {cells} | {p['decode_ms']:>10.2f} {verify}")
    title = (
        "CUDA graphs at 61 layers: decode_61 = graphed decode + (58 - n_moe) t_moe(bs, 1) "
        "+ (3 - n_dense) t_dense(bs, 1), verify_61(k) alike with t(bs, k + 1); "
        "chain + extend as measured"
    )
    _print_speedup(mtp.get("speedup_graph_61", []), mtp["accept_lengths"], title)


def print_profile(profile: dict[str, Any]) -> None:
    """The top device ops of the graphed decode and draft steps, and time per call."""
    if "error" in profile or "skipped" in profile:
        print(f"\nkernel profile: {profile.get('error') or profile['skipped']}")
        return
    for key, title in (("decode", "decode step"), ("draft_step", "one draft step (chain)")):
        p = profile.get(key)
        if p is None or "skipped" in p:
            print(f"\nkernel profile, {title}: {p and p['skipped']}")
            continue
        print(
            f"\nkernel profile, graphed {title}, bs {profile['batch_size']}, context "
            f"{profile['context']}: wall {p['wall_ms']:.3f} ms per call (host padding + "
            f"planning + replay), device span {_fmt(p['span_ms'], '.3f')} ms, device ops "
            f"{p['kernel_ms']:.3f} ms ({p['ops_per_call']:.0f} ops), wall - ops "
            f"{p['host_ms']:.3f} ms"
        )
        print(f"{'ms/call':>8} {'share':>6} {'n/call':>6}  op")
        for op in p["top"]:
            print(
                f"{op['ms']:>8.4f} {op['share']:>6.1%} {op['per_call']:>6.1f}  {op['name'][:100]}"
            )


def _print_speedup(rows: list[dict[str, Any]], accept: list[str], title: str) -> None:
    print(f"\nspeedup per accept length a ({title}; '-' where a > k + 1)")
    print(f"{'bs':>4} {'k':>2} {'round ms':>9} {'break-even a':>12} | "
          + " ".join(f"{'a=' + a:>6}" for a in accept))  # fmt: skip
    for r in rows:
        cells = " ".join(f"{_fmt(r['speedup'][a], '6.2f'):>6}" for a in accept)
        print(
            f"{r['batch_size']:>4} {r['num_steps']:>2} {r['round_ms']:>9.3f} "
            f"{r['break_even_accept_length']:>12.2f} | {cells}"
        )


def print_report(result: dict[str, Any]) -> None:
    """All tables of a finished run."""
    print_header(result)
    if result["prefill"]:
        print_prefill(result["prefill"])
    if result["decode"]:
        print_decode(result["decode"])
        print_decode_graphs(result["decode"])
    if result.get("mtp"):
        print_mtp(result["mtp"])
    if result.get("profile_graphs"):
        print_profile(result["profile_graphs"])
