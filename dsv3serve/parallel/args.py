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


def layout_from_args(args: argparse.Namespace) -> ParallelConfig:
    """The ParallelConfig the layout flags describe (validated)."""
    return ParallelConfig(**{name: getattr(args, name) for name in ParallelConfig.model_fields})
