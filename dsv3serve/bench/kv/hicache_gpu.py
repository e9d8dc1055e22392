"""The hierarchical cache on one GPU: load-back bandwidth and the TTFT of a host-tier hit.

    python -m dsv3serve.bench.kv.hicache_gpu --out hicache_h200.json            # one GPU
    python -m dsv3serve.bench.kv.hicache_gpu --device cpu --out smoke.json      # CPU smoke

1. **Load-back bandwidth**: ``HostKVPool.load`` of ``--bw-pages`` pages of a DeepSeek-V3
   pool (``--layers`` layers x 576 values, bf16, ``--page-size`` tokens a page) from pinned
   host memory into the device pool, against a plain host-to-device copy of the same bytes
   (one pinned tensor) in the same run; also ``backup`` (device to host).
2. **TTFT of a host-tier hit**: an engine (``--model`` at full width, ``--model-layers``
   layers, dummy weights) prefills a ``--prefix-len``-token prompt, a filler prompt of the
   same length pushes it out of the device pool, then the prompt comes back with another
   last token: its TTFT with the hierarchical cache (loaded back from host) against without
   it (recomputed), and the cold first prefill for reference.

Prints a table and writes JSON. Timings are not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dsv3serve.kvcache.host_pool import HostKVPool
from dsv3serve.kvcache.pool import MLAKVPool

_DEFAULTS = {
    "cuda": {"bw_pages": 256, "layers": 61, "iters": 10, "model": "deepseek-v3", "prefix": 16384},
    "cpu": {"bw_pages": 16, "layers": 4, "iters": 2, "model": "tiny", "prefix": 128},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, default=Path("hicache_gpu.json"))
    p.add_argument("--bw-pages", type=int, help="pages loaded back per timed copy")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layers", type=int, help="KV layers of the bandwidth pool (61: V3)")
    p.add_argument("--iters", type=int, help="timed repeats of each copy")
    p.add_argument("--model", help="engine model for the TTFT part ('deepseek-v3', 'tiny')")
    p.add_argument("--model-layers", type=int, default=4, help="layers of the preset model")
    p.add_argument("--prefix-len", type=int, help="prompt tokens of the revisited prefix")
    p.add_argument("--skip-ttft", action="store_true")
    ns = p.parse_args(argv)
    defaults = _DEFAULTS[ns.device]
    ns.bw_pages = ns.bw_pages or defaults["bw_pages"]
    ns.layers = ns.layers or defaults["layers"]
    ns.iters = ns.iters or defaults["iters"]
    ns.model = ns.model or defaults["model"]
    ns.prefix_len = ns.prefix_len or defaults["prefix"]
    return ns


def _timed(fn: Any, iters: int, device: str) -> float:
    """Seconds per call of ``fn`` (after one warm-up), the device drained around it."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bandwidth(ns: argparse.Namespace) -> dict[str, Any]:
    """Load-back and backup GB/s of ``HostKVPool`` against a plain pinned H2D copy."""
    pages = ns.bw_pages
    pool = MLAKVPool(ns.layers, 2 * pages, ns.page_size, dtype=torch.bfloat16, device=ns.device)
    host = HostKVPool(pool, pages)
    nbytes = host.nbytes
    host_ids, dev_ids = list(range(pages)), list(range(pages, 2 * pages))
    load_s = _timed(lambda: host.load(host_ids, dev_ids), ns.iters, ns.device)
    backup_s = _timed(lambda: host.backup(dev_ids, host_ids), ns.iters, ns.device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ns.device == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=ns.device)
    plain_s = _timed(lambda: target.copy_(pinned, non_blocking=True), ns.iters, ns.device)
    return {
        "pages": pages,
        "bytes": nbytes,
        "load_gbps": nbytes / load_s / 1e9,
        "backup_gbps": nbytes / backup_s / 1e9,
        "plain_h2d_gbps": nbytes / plain_s / 1e9,
        "load_vs_plain": plain_s / load_s,
    }


def _engine(ns: argparse.Namespace, tier: bool) -> Any:
    from dsv3serve.engine.config import EngineConfig
    from dsv3serve.engine.engine import Engine

    fields: dict[str, Any] = {
        "model": ns.model,
        "device": ns.device,
        "page_size": ns.page_size,
        # one prompt and one page: the filler evicts every page of the prefix
        "num_kv_tokens": ns.prefix_len + ns.page_size,
        "max_model_len": ns.prefix_len + ns.page_size,
        "chunked_prefill_size": 8192,
        "disable_cuda_graph": True,
        "enable_hierarchical_cache": tier,
    }
    if ns.model != "tiny":
        fields |= {"load_format": "dummy", "hf_overrides": {"num_hidden_layers": ns.model_layers}}
    if ns.device == "cuda":
        fields |= {"attention_backend": "flashinfer", "moe_backend": "triton"}
    return Engine(EngineConfig(**fields))


def _ttft(engine: Any, request_id: str, prompt: list[int]) -> float:
    from dsv3serve.engine.request import Request
    from dsv3serve.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(Request(request_id, params, prompt_ids=prompt))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def ttft(ns: argparse.Namespace, tier: bool) -> dict[str, Any]:
    """Cold prefill, filler, then the revisit: TTFTs and what the revisit prefilled."""
    engine = _engine(ns, tier)
    rng = random.Random(0)
    vocab = engine.model_cfg.vocab_size
    prefix = [rng.randrange(2, vocab) for _ in range(ns.prefix_len)]  # whole pages
    filler = [rng.randrange(2, vocab) for _ in range(ns.prefix_len + 1)]
    cold = _ttft(engine, "cold", [*prefix, 11])
    _ttft(engine, "filler", filler)
    before = engine.scheduler.num_prefill_tokens
    revisit = _ttft(engine, "revisit", [*prefix, 12])
    state = engine.engine_state()
    return {
        "hierarchical_cache": tier,
        "cold_ttft_s": cold,
        "revisit_ttft_s": revisit,
        "revisit_prefill_tokens": engine.scheduler.num_prefill_tokens - before,
        "host_hit_tokens": state.host_hits,
        "host_loaded_pages": state.host_loaded_pages,
        "host_load_seconds": state.host_load_seconds,
    }


def table(result: dict[str, Any]) -> str:
    bw = result["bandwidth"]
    lines = [
        f"load-back {bw['load_gbps']:.2f} GB/s, plain H2D {bw['plain_h2d_gbps']:.2f} GB/s "
        f"({bw['load_vs_plain'] * 100:.0f} %), backup {bw['backup_gbps']:.2f} GB/s, "
        f"{bw['pages']} pages, {bw['bytes'] / 1e6:.1f} MB",
    ]
    for run in result.get("ttft", []):
        lines.append(
            f"tier {'on ' if run['hierarchical_cache'] else 'off'}: cold TTFT "
            f"{run['cold_ttft_s'] * 1e3:.1f} ms, revisit TTFT {run['revisit_ttft_s'] * 1e3:.1f} "
            f"ms, revisit prefilled {run['revisit_prefill_tokens']} tokens, loaded "
            f"{run['host_loaded_pages']} pages in {run['host_load_seconds'] * 1e3:.1f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda needs a GPU", file=sys.stderr)
        return 1
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(ns).items()}}
    result["bandwidth"] = bandwidth(ns)
    if not ns.skip_ttft:
        result["ttft"] = [ttft(ns, tier) for tier in (True, False)]
    if ns.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    ns.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
