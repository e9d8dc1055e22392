"""The layout flags every ``dsv3serve`` command takes (SGLang's spellings)."""

from __future__ import annotations

import argparse

from dsv3serve.parallel.config import ParallelConfig


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """``--tp-size`` ... ``--deepep-mode``, each setting the ParallelConfig field of its name."""
    p.add_argument("--tp-size", type=int, default=1, help="ranks in the group, one per device")
    p.add_argument("--dp-size", type=int, default=1, help="DP-attention ranks (= tp-size)")
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--ep-size", type=int, default=1, help="ranks the routed experts split over")
    p.add_argument("--moe-dense-tp-size", type=int, default=None, help="1: dense MLP replicated")
    p.add_argument("--enable-dp-lm-head", action="store_true")
    p.add_argument("--moe-a2a-backend", default="none", choices=["none", "deepep"])
    p.add_argument("--deepep-mode", default="auto", choices=["auto", "normal", "low_latency"])
    p.add_argument("--enable-eplb", action="store_true", help="rebalance experts while serving")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0, help="extra expert slots")
    p.add_argument("--init-expert-location", default=None, help="expert-load dump to place by")
    p.add_argument("--eplb-rebalance-num-iterations", type=int, default=1000)


def layout_from_args(args: argparse.Namespace) -> ParallelConfig:
    """The ParallelConfig the layout flags describe (validated)."""
    return ParallelConfig(**{name: getattr(args, name) for name in ParallelConfig.model_fields})
