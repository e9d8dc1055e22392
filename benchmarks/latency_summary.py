"""Print the parts of a ``bench model --profile-graphs`` JSON that issue 34 is judged on.

    python benchmarks/latency_summary.py bench_model.json

The graphed batch-1 decode against the same run's roofline, the MTP step costs through
graphs and their 61-layer projection, and per profiled call (decode, draft step, chain,
verify): wall time, device op time, op count, the top device ops and host functions.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _decode(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if "graph_ms" not in r:
            print("decode:", r)
            continue
        pct = 100 / r["graph_ratio"]
        print(
            f"decode bs {r['batch_size']} ctx {r['context']}: graph {r['graph_ms']:.3f} ms, "
            f"roofline {r['roofline_ms']:.3f} ms, ratio {r['graph_ratio']:.2f} = {pct:.0f}%"
        )


def _mtp(mtp: dict[str, Any] | None) -> None:
    if not mtp:
        return
    for r in mtp.get("rows", []):
        g = r.get("graph", {})
        print(
            f"mtp bs {r['batch_size']}: graph decode {g.get('decode_ms')}, draft "
            f"{g.get('draft_ms')}, chain {g.get('chain_ms')}, verify {g.get('verify_ms')}, "
            f"extend {g.get('extend_ms')}"
        )
    for s in mtp.get("speedup_graph_61", []):
        print(
            f"  61-layer k={s['num_steps']} bs {s['batch_size']}: round {s['round_ms']:.2f} ms, "
            f"break-even {s['break_even_accept_length']:.2f}, speedup {s['speedup']}"
        )


def _call(name: str, p: dict[str, Any]) -> None:
    if "wall_ms" not in p:
        print(name, p)
        return
    print(
        f"\n{name}: wall {p['wall_ms']:.3f} ms, device ops {p['kernel_ms']:.3f} ms "
        f"({p['ops_per_call']:.0f} ops), span {p['span_ms']}, host {p['host_ms']:.3f} ms"
    )
    for op in p["top"][:10]:
        print(f"   {op['ms'] * 1e3:8.1f} us  x{op['per_call']:<4.0f} {op['name'][:90]}")
    host = p.get("host", {})
    print(f"  host (cProfile, {host.get('profiled_ms_per_call', 0):.3f} ms/call profiled):")
    for fn in host.get("top", [])[:14]:
        print(
            f"   cum {fn['cum_ms']:7.3f}  self {fn['self_ms']:7.3f}  x{fn['ncalls']:<5.1f} "
            f"{fn['fn'][:90]}"
        )


def main(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    print("ceilings:", {k: round(v, 3) for k, v in d.get("ceilings", {}).items()})
    _decode(d.get("decode", []))
    _mtp(d.get("mtp"))
    prof = d.get("profile_graphs") or {}
    for name in ("decode", "draft_step", "chain", "verify"):
        if name in prof:
            _call(name, prof[name])


if __name__ == "__main__":
    main(sys.argv[1])
