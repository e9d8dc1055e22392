"""Check the torch_dist connector between a prefill and a decode engine on two devices.

    python -m dsv3serve.bench.kv.check_gpu --out result.json               # cuda:0 -> cuda:1, NCCL
    python -m dsv3serve.bench.kv.check_gpu --device cpu --out result.json  # two CPU processes, gloo

Two spawned processes (:mod:`dsv3serve.bench.kv.check_sides`): a prefill engine on cuda:0 and a
decode engine, plus a colocated reference engine, on cuda:1 (tiny model). It checks

1. the decode side's greedy tokens equal the colocated run's, and reports the largest
   difference between the logits of the first decode step;
2. the pages arrive bit-exact (SHA-256 of their raw bytes on both sides);
3. the bandwidth of one large transfer (DeepSeek-V3 pages: 61 layers x 576 bf16) through
   the connector, against a plain copy of the same bytes between the two devices.

Prints a table, writes JSON, exits 1 if a check failed. Timings are not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from dsv3serve.bench.kv import check_sides

_DEFAULTS = {"cuda": {"bw_tokens": 8192, "bw_iters": 10}, "cpu": {"bw_tokens": 1024, "bw_iters": 3}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=Path("kv_transfer_check.json"))
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3")
    parser.add_argument("--bw-tokens", type=int, help="tokens of the large transfer")
    parser.add_argument("--bw-page-size", type=int, default=64)
    parser.add_argument("--bw-iters", type=int)
    parser.add_argument("--chunk-mib", type=float, default=64.0, help="receiver's chunk size")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per step")
    parser.add_argument("--logits-atol", type=float, default=0.05)
    return parser.parse_args(argv)


def side_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The JSON-safe arguments both sides share."""
    defaults = _DEFAULTS[ns.device]
    two_gpus = ns.device == "cuda"
    return {
        "prefill_device": "cuda:0" if two_gpus else "cpu",
        "decode_device": "cuda:1" if two_gpus else "cpu",
        "num_prompts": ns.num_prompts,
        "kv_cache_dtypes": [d for d in ns.kv_cache_dtypes.split(",") if d],  # "": skip
        "chunk_mib": ns.chunk_mib,
        "bw_tokens": ns.bw_tokens or defaults["bw_tokens"],
        "bw_page_size": ns.bw_page_size,
        "bw_iters": ns.bw_iters or defaults["bw_iters"],
        "timeout": ns.timeout,
    }


def run_sides(args: dict[str, Any], workdir: Path) -> dict[str, dict[str, Any]]:
    """Spawn both sides, wait for them, return each side's report."""
    ctx = mp.get_context("spawn")
    prefill_end, decode_end = ctx.Pipe()
    procs, outs = {}, {}
    for side, end, fn in (
        ("prefill", prefill_end, check_sides.prefill_side),
        ("decode", decode_end, check_sides.decode_side),
    ):
        outs[side] = workdir / f"{side}.json"
        own = args | {"device": args[f"{side}_device"], "out": str(outs[side])}
        procs[side] = ctx.Process(target=fn, args=(end, own), name=f"kv-check-{side}")
        procs[side].start()
    budget = args["timeout"] * (len(args["kv_cache_dtypes"]) * args["num_prompts"] + 10)
    for proc in procs.values():
        proc.join(timeout=budget)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return {side: _read_report(outs[side], procs[side]) for side in procs}


def _read_report(path: Path, proc: mp.process.BaseProcess) -> dict[str, Any]:
    if not path.exists():
        return {"ok": False, "error": f"{proc.name} exited with {proc.exitcode} and no report"}
    return json.loads(path.read_text()) | {"exitcode": proc.exitcode}


def _environment(args: dict[str, Any]) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    env["backend"] = "nccl" if args["prefill_device"].startswith("cuda") else "gloo"
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def verdict(result: dict[str, Any], atol: float) -> list[str]:
    """What failed, as sentences (empty: every check passed)."""
    failures = [f"{side}: {r['error']}" for side, r in result["sides"].items() if not r["ok"]]
    if failures:
        return failures
    for side, report in result["sides"].items():
        if report.get("exitcode") != 0:  # e.g. a crash while tearing down
            failures.append(f"{side} process exited with {report.get('exitcode')}")
    decode = result["sides"]["decode"]["result"]
    for row in decode["tokens"]:
        where = f"{row['request_id']} ({row['kv_cache_dtype']})"
        if not row["tokens_equal"]:
            failures.append(f"{where}: tokens {row['pd_tokens']} != {row['colocated_tokens']}")
        if not row["pages_bit_exact"]:
            failures.append(f"{where}: pages differ after the transfer")
        if row["first_decode_logits_max_abs_diff"] > atol:
            failures.append(f"{where}: logits differ by {row['first_decode_logits_max_abs_diff']}")
    if not decode["bandwidth"]["pages_bit_exact"]:
        failures.append("bandwidth transfer: pages differ after the transfer")
    return failures


_PATHS = (
    ("torch_dist receive, end to end", "receive"),
    ("bare send/recv of one buffer (same backend)", "p2p"),
    ("gather pages -> buffer (prefill device)", "gather"),
    ("scatter buffer -> pages (decode device)", "scatter"),
    ("device copy (tensor.copy_ across devices)", "copy"),
)


def print_table(result: dict[str, Any]) -> None:
    decode = result["sides"]["decode"].get("result")
    if decode is None:
        return
    print(f"{'request':<24} {'kv dtype':<9} {'prompt':>6} {'tokens ==':>9} {'pages ==':>8} "
          f"{'max |dlogit|':>12} {'transfer ms':>11}")  # fmt: skip
    for row in decode["tokens"]:
        print(f"{row['request_id']:<24} {row['kv_cache_dtype']:<9} {row['prompt_tokens']:>6} "
              f"{row['tokens_equal']!s:>9} {row['pages_bit_exact']!s:>8} "
              f"{row['first_decode_logits_max_abs_diff']:>12.3g} "
              f"{row['transfer_seconds'] * 1e3:>11.2f}")  # fmt: skip
    bw = decode["bandwidth"]
    print(f"\nlarge transfer: {bw['tokens']} tokens x {bw['layers']} layers x {bw['kv_dim']} "
          f"{bw['dtype']} = {bw['nbytes'] / 1e6:.1f} MB in {bw['pages']} pages of "
          f"{bw['page_size']} (bit-exact: {bw['pages_bit_exact']})")  # fmt: skip
    bw = bw | result["sides"]["prefill"]["result"]
    print(f"{'path (same bytes)':<44} {'median s':>10} {'GB/s':>8} {'/ copy':>7}")
    for name, key in _PATHS:
        seconds, gbps = bw[f"{key}_seconds_median"], bw[f"{key}_gbps"]
        print(f"{name:<44} {seconds:>10.5f} {gbps:>8.2f} {gbps / bw['copy_gbps']:>7.2f}")


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from dsv3serve.model.tiny import cached_tiny_checkpoint

    cached_tiny_checkpoint()  # made once here, not raced by the two sides (no CUDA used)
    args = side_args(ns)
    with tempfile.TemporaryDirectory(prefix="kv-check-") as workdir:
        sides = run_sides(args, Path(workdir))
    result: dict[str, Any] = {"args": args, "environment": _environment(args), "sides": sides}
    failures = verdict(result, ns.logits_atol)
    result["ok"], result["failures"] = not failures, failures
    ns.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print("\nOK" if not failures else "\nFAILED:\n" + "\n".join(failures))
    print(f"wrote {ns.out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
