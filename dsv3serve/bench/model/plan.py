"""What ``bench model`` measures: the sizes and iteration counts, from flags or defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from dsv3serve.bench.model.batches import kv_tokens_needed


@dataclass(frozen=True)
class Plan:
    """The points to measure and how many times."""

    prefill_lens: list[int]
    decode_batch_sizes: list[int]
    decode_contexts: list[int]
    mtp_batch_sizes: list[int]
    mtp_context: int
    mtp_steps: list[int]
    warmup: int
    iters: int

    @property
    def prefill_iters(self) -> int:
        """Prefill steps are long and steady: fewer timed iterations."""
        return min(self.iters, 5)

    def kv_tokens(self, page_size: int) -> int:
        """Pool slots for the largest decode, verify and prefill batch."""
        decode = [
            kv_tokens_needed(self.decode_batch_sizes, c, 1, page_size) for c in self.decode_contexts
        ]
        new_tokens = max(self.mtp_steps, default=0) + 1
        verify = kv_tokens_needed(self.mtp_batch_sizes, self.mtp_context, new_tokens, page_size)
        prefill = -(-max(self.prefill_lens, default=0) // page_size) * page_size
        return max([*decode, verify, prefill, page_size])


def make_plan(args: argparse.Namespace) -> Plan:
    """Flags where given, else the ``--quick`` or the full defaults."""

    def pick(value: Any, quick: Any, full: Any) -> Any:
        return value if value is not None else (quick if args.quick else full)

    plan = Plan(
        prefill_lens=pick(args.prefill_lens, [1024], [1024, 4096]),
        decode_batch_sizes=pick(args.decode_batch_sizes, [1, 32], [1, 8, 32, 128]),
        decode_contexts=pick(args.decode_contexts, [1024], [1024, 4096]),
        mtp_batch_sizes=[] if args.no_mtp else pick(args.mtp_batch_sizes, [1, 8], [1, 8, 32]),
        mtp_context=args.mtp_context,
        mtp_steps=args.mtp_steps,
        warmup=pick(args.warmup, 1, 2),
        iters=pick(args.iters, 3, 10),
    )
    if plan.iters < 1 or plan.warmup < 0 or min(plan.mtp_steps, default=1) < 1:
        raise ValueError(
            f"expected iters >= 1, warmup >= 0 and mtp steps >= 1, got iters {plan.iters}, "
            f"warmup {plan.warmup}, mtp steps {plan.mtp_steps}"
        )
    return plan
