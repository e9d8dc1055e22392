"""Issue 35's tables from two ``bench group`` JSONs of one run: one GPU and the group.

    python benchmarks/group_step_report.py OUT/group_one_gpu.json OUT/group_dp2ep2.json

Prints markdown for ``docs/perf/group_step.md``: decode per batch (step time and its ratio to
the rank's roofline, against the must-hold's bound), prefill per GPU (the group's share of the
one-GPU rate), and the profiled steps side by side (device time by kind of op, device span,
host time with the device idle). Numbers are copied from the JSONs; ratios are computed here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

DECODE_BOUND = {256: 1.6, 64: 1.5}  # per rank -> the most x roofline the must-hold allows
PREFILL_SHARE = 0.8  # the group's prefill per GPU against one GPU's, at least
STEP_FIELDS = ("wall_ms", "span_ms", "host_idle_ms", "kernel_ms")  # then kernel ms by kind


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def decode_table(one: dict[str, Any], group: dict[str, Any]) -> list[str]:
    """Rows per batch size (per rank) present in the group's run."""
    ones = {r["per_rank"]: r for r in one["decode"]}
    lines = [
        "| per rank | one GPU: step ms, x roofline | group: step ms, x roofline | "
        "tok/s per GPU: one, group | bound | holds |",
        "|---|---|---|---|---|---|",
    ]
    for g in group["decode"]:
        o = ones.get(g["per_rank"], {})
        bound = DECODE_BOUND.get(g["per_rank"])
        ratio = g.get("x_roofline")
        holds = "-" if bound is None or ratio is None else ("yes" if ratio <= bound else "no")
        holds = _partial(g, "group") or holds
        holds += f" ({_partial(o, 'one GPU')})" if _partial(o, "one GPU") else ""
        lines.append(
            f"| {g['per_rank']} | {_fmt(o.get('median_step_ms'))}, {_fmt(o.get('x_roofline'))} "
            f"| {_fmt(g['median_step_ms'])}, {_fmt(ratio)} "
            f"| {_fmt(o.get('tok_s_per_gpu'), 0)}, {_fmt(g['tok_s_per_gpu'], 0)} "
            f"| {_fmt(bound, 1)} | {holds} |"
        )
    return lines


def _partial(row: dict[str, Any], who: str) -> str:
    """Why a row is no measure of its batch: a timed step ran fewer sequences than it has
    (``bench group``'s ``full_batch``; absent in older JSONs: not judged)."""
    if row.get("full_batch", True):
        return ""
    return f"{who}: batch not full, {row['min_tokens_per_step']} of {row['sequences']}"


def prefill_line(one: dict[str, Any], group: dict[str, Any]) -> str:
    """The group's prefill tok/s per GPU as a share of one GPU's."""
    o, g = one.get("prefill"), group.get("prefill")
    if not o or not g:
        return "prefill: not measured in both runs"
    share = g["tok_s_per_gpu"] / o["tok_s_per_gpu"]
    holds = "holds" if share >= PREFILL_SHARE else "does not hold"
    return (
        f"prefill of {g['length']}-token prompts: one GPU {o['tok_s_per_gpu']:.0f} tok/s, group "
        f"{g['tok_s_per_gpu']:.0f} tok/s per GPU = {share:.1%} of one GPU (bound "
        f"{PREFILL_SHARE:.0%}: {holds})"
    )


def _profiles(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each profiled step kind of a run: ``decode@<per rank>`` and ``prefill``."""
    found = {f"decode@{r['per_rank']}": r["profile"] for r in run["decode"] if "profile" in r}
    if "profile" in run.get("prefill", {}):
        found["prefill"] = run["prefill"]["profile"]
    return found


def profile_table(one: dict[str, Any], group: dict[str, Any]) -> list[str]:
    """ms per step, one GPU / group, for each step kind profiled on a GPU in both runs."""
    ones, groups = _profiles(one), _profiles(group)
    kinds = [
        k for k in groups if "categories_ms" in groups[k] and "categories_ms" in ones.get(k, {})
    ]
    if not kinds:
        return ["profile: no step profiled on a GPU in both runs"]
    cats: list[str] = []
    for k in kinds:
        for c in (*ones[k]["categories_ms"], *groups[k]["categories_ms"]):
            if c not in cats:
                cats.append(c)

    def cell(p: dict[str, Any], key: str) -> str:
        return _fmt(p[key] if key in STEP_FIELDS else p["categories_ms"].get(key, 0.0))

    lines = ["| ms per step (one GPU / group) | " + " | ".join(kinds) + " |"]
    lines.append("|---" * (len(kinds) + 1) + "|")
    for key in (*STEP_FIELDS, *cats):
        cells = [f"{cell(ones[k], key)} / {cell(groups[k], key)}" for k in kinds]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def report(one: dict[str, Any], group: dict[str, Any]) -> str:
    """The markdown: decode table, prefill line, profile table."""
    parts = [*decode_table(one, group), "", prefill_line(one, group), ""]
    return "\n".join([*parts, *profile_table(one, group)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("one", type=Path, help="bench group JSON of one GPU")
    p.add_argument("group", type=Path, help="bench group JSON of the group, same run")
    args = p.parse_args(argv)
    print(report(json.loads(args.one.read_text()), json.loads(args.group.read_text())), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
