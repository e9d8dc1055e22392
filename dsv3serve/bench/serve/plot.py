"""PNGs: a sweep's median and P99 TTFT, TPOT and E2E latency against output throughput;
a chaos run's throughput over time with its kills."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsv3serve.bench.serve.config import BenchServeConfig

PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e_latency", "E2E latency"))


def point_label(record: dict[str, Any], config: BenchServeConfig) -> str:
    """How a sweep point is named on the plot: its concurrency or its request rate."""
    if config.concurrency_sweep:
        return f"c={record['max_concurrency']}"
    return f"{record['request_rate']:g} req/s"


def _panel(
    ax: Any, records: list[dict[str, Any]], metric: str, title: str, labels: list[str]
) -> None:
    xs = [r["output_throughput"] for r in records]
    for stat, style in (("median", "o-"), ("p99", "s--")):
        ax.plot(xs, [r[f"{stat}_{metric}_ms"] for r in records], style, label=stat)
    for x, y, text in zip(xs, [r[f"p99_{metric}_ms"] for r in records], labels, strict=True):
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.margins(x=0.15, y=0.15)  # room for the point labels
    ax.set_title(title)
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel(f"{title} (ms)")
    ax.grid(alpha=0.3)
    ax.legend()


def plot_sweep(records: list[dict[str, Any]], config: BenchServeConfig, path: Path) -> None:
    """Write the sweep's latency-throughput PNG to ``path`` (matplotlib's Agg canvas).

    The figure is drawn without pyplot, so no global backend or figure state changes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = [point_label(r, config) for r in records]
    fig = Figure(figsize=(5 * len(PANELS), 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS))
    for ax, (metric, title) in zip(axes, PANELS, strict=True):
        _panel(ax, records, metric, title, labels)
    first = records[0]
    fig.suptitle(
        f"{first['model']} via {config.endpoint}: {config.dataset_name}, "
        f"{first['num_prompts']} prompts"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_chaos(record: dict[str, Any], path: Path) -> None:
    """Write a ``--chaos`` run's PNG: streamed chunks per second and completions / failures
    per second over time, a line at each kill."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    chaos = record["chaos"]
    line = chaos["timeline"]
    fig = Figure(figsize=(10, 6))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(line["bin_start_s"], line["chunks"], "-", label="streamed chunks/s (~tok/s)")
    top.set_ylabel("chunks / s")
    bottom.bar(line["bin_start_s"], line["completed"], width=0.9, label="completed / s")
    bottom.bar(line["bin_start_s"], line["failed"], width=0.9, label="failed / s", color="red")
    bottom.set_ylabel("requests / s")
    bottom.set_xlabel("time since the run started (s)")
    for ax in (top, bottom):
        for kill in chaos["kills"]:
            ax.axvline(kill["killed_at_s"], color="black", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    for kill in chaos["kills"]:
        top.annotate(
            f"kill {kill['deployment']}",
            (kill["killed_at_s"], 0),
            fontsize=8,
            textcoords="offset points",
            xytext=(3, 4),
        )
    migrated = chaos["migrations"]
    fig.suptitle(
        f"{record['model']}: {record['num_prompts']} requests, "
        f"{chaos['failed_requests']} failed, "
        f"{'?' if migrated is None else int(migrated)} migrated"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
