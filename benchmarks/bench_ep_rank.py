"""One EP rank's share of the FULL 61-layer DeepSeek-V3 on one GPU (issue 14), timing only.

    python benchmarks/bench_ep_rank.py --layout ep8    # one H200: rank 0 of DP8 + EP8, ~103 GB
    python benchmarks/bench_ep_rank.py --layout ep16   # one H100: rank 0 of DP16 + EP16, ~62 GB

Builds rank 0's shard (attention, 3 dense layers, the whole lm_head, 256 / n experts per MoE
layer; dummy FP8 weights, bf16 compute, flashinfer attention + Triton MoE), with
dispatch/combine replaced by a same-rank loopback (timing only), fills the KV pool with random
latents, and times graphed decode steps at batch 1, 32 and 128 with 4K context against the
bytes the rank must read over the copy bandwidth measured first in the same run. Prints a
table and writes JSON (``--out``, default ``docs/perf/ep_rank_<gpu>.json``). The code lives in
``dsv3serve.bench.ep_rank.run``; ``--help`` lists the flags.
"""

from __future__ import annotations

import argparse

from dsv3serve.bench.ep_rank.run import add_args, run_ep_rank


def main() -> None:
    parser = add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    run_ep_rank(parser.parse_args())


if __name__ == "__main__":
    main()
