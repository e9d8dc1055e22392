"""A DP2 + EP2 group on CPU with no KV size given (issue 45): its ranks share the host's CPU
KV budget (``cpu_kv_cache_space_gib``, 4 GiB: 2 GiB each), run a generate to the end, and
the follower's peak RSS stays under 4 GB (a rank took 16 GB of a 24 GB host before, when the
pool was 0.85 of the host's free memory in every rank)."""

from __future__ import annotations

from pathlib import Path

from dsv3serve.engine.llm import LLM
from dsv3serve.kvcache.sizing import GIB
from dsv3serve.sampling.sampling_params import SamplingParams

RANK_RSS_LIMIT = 4 * 10**9


def peak_rss(pid: int) -> int:
    """The process's peak resident set (``VmHWM``) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"expected VmHWM in /proc/{pid}/status, found none")


def test_dp2_ep2_group_without_a_kv_size_shares_the_host_budget() -> None:
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    with LLM("tiny", tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2) as llm:
        outs = llm.generate(["The capital of France is", "Hello"], params)
        (follower,) = llm._group.processes
        follower_peak = peak_rss(follower.pid)  # before STOP: the follower is alive
        size = llm.engine.runner.kv_size
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert size.reason == "capped at 2 GiB: cpu_kv_cache_space_gib 4 shared by 2 ranks on this host"
    assert 2 * GIB - size.page_bytes < size.nbytes <= 2 * GIB
    assert follower_peak < RANK_RSS_LIMIT, f"follower peak RSS {follower_peak / 1e9:.2f} GB"
