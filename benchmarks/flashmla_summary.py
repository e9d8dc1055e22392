"""Print the FlashMLA device run's decode comparison from its ``bench model`` JSONs.

    python benchmarks/flashmla_summary.py [--merge OUT.json] NAME=bench_model.json [NAME=...]

Per (batch, context): each run's eager step, graphed step (batch <= the graph limit) and
61-layer projection in ms, and each run's time over the first run's (below 1: faster).
``--merge``: also write the runs' JSONs as one object keyed by NAME (a device run returns
few files).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _rows(path: str) -> dict[tuple[int, int], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return {(r["batch_size"], r["context"]): r for r in data.get("decode") or []}


def _ms(row: dict[str, Any] | None, key: str) -> float | None:
    if row is None or "error" in row:
        return None
    value = row["projected_61"]["ms"] if key == "projected" else row.get(key)
    return value if isinstance(value, (int, float)) else None


def _cell(value: float | None, base: float | None) -> str:
    if value is None:
        return f"{'-':>18}"
    ratio = f" ({value / base:.2f}x)" if base else ""
    return f"{value:9.3f}{ratio:>9}"


def _merge(pairs: list[list[str]], out: str) -> None:
    found = {
        name: json.loads(Path(path).read_text()) for name, path in pairs if Path(path).exists()
    }
    Path(out).write_text(json.dumps(found, indent=1))


def main(args: list[str]) -> None:
    merge = None
    if args[:1] == ["--merge"]:
        merge, args = args[1], args[2:]
    pairs = [a.split("=", 1) for a in args]
    if merge:
        _merge(pairs, merge)
    runs = [(name, _rows(path)) for name, path in pairs if Path(path).exists()]
    if not runs:
        print("no bench model JSON found")
        return
    points = sorted({p for _, rows in runs for p in rows})
    for key in ("ms", "graph_ms", "projected"):
        print(f"decode step {key} (ms; x the first run)")
        print(f"{'batch':>6} {'ctx':>6} " + " ".join(f"{name:>18}" for name, _ in runs))
        for point in points:
            base = _ms(runs[0][1].get(point), key)
            cells = [_cell(_ms(rows.get(point), key), base) for _, rows in runs]
            print(f"{point[0]:>6} {point[1]:>6} " + " ".join(cells))
    errors = [(n, p, r["error"]) for n, rows in runs for p, r in rows.items() if "error" in r]
    for name, point, error in errors:
        print(f"{name} {point}: {error}")


if __name__ == "__main__":
    main(sys.argv[1:])
