"""Dispatch / combine metering on real spawned gloo ranks (2), and the low-latency path's
CUDA-graph contract (fixed shapes, padding, no host sync) over ``fake_deep_ep``.

Bytes are checked exactly: the rows on each rank's expert side, counted here from the
routing of every rank's tokens, times the row each backend sends. Fresh random routing
each session (seed in messages).
"""

from __future__ import annotations

import pytest
import torch
from deepep_util import MAX_TOKENS
from dispatch_util import HIDDEN, NUM_EXPERTS, TOPK, Case, make_case
from ep_step_util import HostSyncGuard, run_step_ranks
from fresh_seed import session_seed
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsv3serve.cli import build_parser
from dsv3serve.engine.config import EngineConfig
from dsv3serve.metrics import DISPATCH_LATENCY_BUCKETS, DispatchStatsCollector, Identity
from dsv3serve.parallel.dispatch_meter import DispatchMeter, PhaseTotals
from dsv3serve.parallel.dispatch_pack import WireFormat
from dsv3serve.parallel.dispatch_ref import moe_reference

SEED = session_seed()
WORLD = 2
LOCAL = NUM_EXPERTS // WORLD
STEPS = [16, 5, 0, 11, 16]  # real tokens per graph-style step (static buffers of MAX_TOKENS)
BF16_ROW = 2 * HIDDEN
FP8_ROW = HIDDEN + 4 * -(-HIDDEN // 128)


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(SEED)
    return [
        make_case("steps", g, [MAX_TOKENS, MAX_TOKENS], torch.bfloat16),
        make_case("uniform", g, [13, 9], torch.bfloat16),
        make_case("all_to_rank0", g, [8, 5], torch.bfloat16, experts=range(0, LOCAL)),
        make_case("rank1_empty", g, [10, 0], torch.bfloat16),
        make_case("all_empty", g, [0, 0], torch.bfloat16),
    ]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Case], list[dict]]:
    cases = _cases()
    return cases, run_step_ranks(cases, WORLD, tmp_path_factory.mktemp("ep_steps"), STEPS)


def token_copies(case: Case, rank: int) -> int:
    """(token, rank) copies that reach ``rank``: the flat backends' rows."""
    return sum(int(((ids // LOCAL) == rank).any(1).sum()) for ids in case.ids)


def expert_pairs(case: Case, rank: int) -> int:
    """(token, expert) pairs on ``rank``'s experts: the low-latency rows."""
    return sum(int(((ids // LOCAL) == rank).sum()) for ids in case.ids)


def _by_phase(snap: dict) -> dict[str, dict]:
    return {p["phase"]: p for p in snap["phases"]}


@pytest.mark.parametrize("name", ["steps", "uniform", "all_to_rank0", "rank1_empty", "all_empty"])
def test_bytes_are_exact_per_rank_phase_and_backend(ranks, name: str) -> None:
    cases, results = ranks
    case = next(c for c in cases if c.name == name)
    a2a_row = WireFormat(HIDDEN, TOPK, torch.bfloat16).row_bytes
    for rank in range(WORLD):
        flat, pairs = token_copies(case, rank), expert_pairs(case, rank)
        want = {  # per round; each backend ran two rounds
            "a2a": ("a2a", flat * a2a_row, flat * BF16_ROW),
            "normal": ("normal", flat * BF16_ROW, flat * BF16_ROW),
            "low_latency": ("low_latency", pairs * BF16_ROW, pairs * BF16_ROW),
            "low_latency_fp8": ("low_latency", pairs * FP8_ROW, pairs * BF16_ROW),
        }
        assert set(results[rank][name]) >= {"a2a", "normal", "low_latency"}
        for backend, (mode, dispatch_bytes, combine_bytes) in want.items():
            if backend not in results[rank][name]:
                continue  # low-latency FP8: cases where every rank has tokens
            snap = results[rank][name][backend]
            assert snap["rank"] == rank and snap["dropped"] == 0
            got = _by_phase(snap)
            assert {p["mode"] for p in snap["phases"]} == {mode}
            where = f"seed {SEED}, {name}, rank {rank}, {backend}"
            assert got["dispatch"]["bytes"] == 2 * dispatch_bytes, where
            assert got["combine"]["bytes"] == 2 * combine_bytes, where
            for phase in got.values():
                assert phase["count"] == 2 and sum(phase["buckets"]) == 2, where
                assert phase["seconds"] > 0, where


def test_self_check_traffic_is_not_counted(ranks) -> None:
    """The factory runs DeepEP's self-check unmetered: an all-empty case counts zero bytes
    although the self-check moved real rows."""
    _, results = ranks
    for rank in range(WORLD):
        for backend in ("normal", "low_latency"):
            assert all(p["bytes"] == 0 for p in results[rank]["all_empty"][backend]["phases"])


def test_metering_off_records_nothing_and_lists_no_meter(ranks) -> None:
    """``metered=False`` (the engine's ``disable_moe_dispatch_metrics``): no phase is
    recorded, no meter is listed for export (no series, rather than zeros), and the
    low-latency pair does no work on its counts; ``rank_parts`` follows the engine flag."""
    _, results = ranks
    for rank in range(WORLD):
        off = results[rank]["_off"]
        assert all(s["phases"] == [] for s in off["snapshots"].values()), off["snapshots"]
        assert off["listed"] == []
        assert off["counts_ops"] == {"dispatch": [], "combine": []}
        assert off["engine_switch"] == {True: False, False: True}


def test_every_engine_command_takes_the_switch() -> None:
    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["warmup"], ["bench", "one-batch"],
                    ["bench", "group"]):  # fmt: skip
        off = parser.parse_args([*command, "--disable-moe-dispatch-metrics"])
        assert EngineConfig.from_args(off).disable_moe_dispatch_metrics, command
        assert not EngineConfig.from_args(parser.parse_args(command)).disable_moe_dispatch_metrics


def test_low_latency_counts_are_summed_once_per_pair(ranks) -> None:
    """The dispatch sums its per-expert counts once (to meter them); the combine reuses
    that count and touches the counts not at all, yet meters the same bytes."""
    cases, results = ranks
    uniform = next(c for c in cases if c.name == "uniform")
    for rank in range(WORLD):
        got = results[rank]["_warm_up"]
        assert got["counts_ops"] == {"dispatch": ["aten.sum.default"], "combine": []}
        phases = _by_phase(got["snapshots"]["low_latency"])
        assert phases["combine"]["bytes"] == expert_pairs(uniform, rank) * BF16_ROW


def test_graph_warm_up_forwards_are_not_metered(ranks) -> None:
    """Two warm-up rounds (``graph_capture.warm_up``, what a capture runs first) and one
    real round per backend: the meters count the real round only."""
    _, results = ranks
    for rank in range(WORLD):
        for backend, snap in results[rank]["_warm_up"]["snapshots"].items():
            counts = {p["phase"]: p["count"] for p in snap["phases"]}
            assert counts == {"dispatch": 1, "combine": 1}, (rank, backend)


def test_exposition_carries_every_rank(ranks) -> None:
    """The collector turns the ranks' snapshots into the Prometheus families, rank-labelled."""
    cases, results = ranks
    snaps = [results[rank]["uniform"]["a2a"] for rank in range(WORLD)]
    registry = CollectorRegistry()
    registry.register(DispatchStatsCollector(Identity("decode", "decode-0", "tiny"), lambda: snaps))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    row = WireFormat(HIDDEN, TOPK, torch.bfloat16).row_bytes
    uniform = next(c for c in cases if c.name == "uniform")
    for rank in range(WORLD):
        labels = {"role": "decode", "replica": "decode-0", "model": "tiny", "rank": str(rank),
                  "phase": "dispatch", "mode": "a2a"}  # fmt: skip
        total = [s for s in families["dsv3serve:moe_dispatch_bytes"].samples
                 if s.name.endswith("_total") and s.labels == labels]  # fmt: skip
        assert [s.value for s in total] == [2 * token_copies(uniform, rank) * row]
        hist = families["dsv3serve:moe_dispatch_seconds"].samples
        count = [s.value for s in hist if s.name.endswith("_count") and s.labels == labels]
        inf = [s.value for s in hist if s.labels == {**labels, "le": "+Inf"}]
        assert count == inf == [2.0]


def test_graph_style_steps_have_fixed_shapes_and_ignore_padding(ranks) -> None:
    """Static input buffers reused every step, a different real count each time, NaN padding
    rows routed to real experts: outputs of the real rows equal the single-rank reference,
    padding rows come back zero, nothing of the padding is sent, shapes never change."""
    cases, results = ranks
    case = cases[0]
    for rank in range(WORLD):
        out = results[rank]["_graph_style"]
        assert len({b for b in out["buffers"]}) == 1, "the static buffers moved or resized"
        assert len({s[3] for s in out["steps"]}) == 1, "the masked layout changed shape"
        for n, combined, counts_sum, shape in out["steps"]:
            assert shape == (LOCAL, MAX_TOKENS * WORLD, HIDDEN)
            step_case = _first(case, n)
            assert counts_sum == expert_pairs(step_case, rank), f"seed {SEED}: padding was sent"
            want = _reference(step_case, rank)
            where = f"seed {SEED}, rank {rank}, {n} real tokens"
            torch.testing.assert_close(combined[:n].float(), want, atol=3e-2, rtol=3e-2, msg=where)
            assert torch.equal(combined[n:], torch.zeros_like(combined[n:])), where


def _first(case: Case, n: int) -> Case:
    """``case`` cut to the first ``n`` tokens of every rank."""
    cut = [[t[:n] for t in ts] for ts in (case.xs, case.ids, case.weights)]
    return Case(f"{case.name}[:{n}]", *cut, case.mats)


def _reference(case: Case, rank: int) -> torch.Tensor:
    """The single-rank result of rank ``rank``'s tokens over all experts (bf16 expert
    inputs and matrices, as the graph-style steps multiply them)."""
    mats = case.mats.to(torch.bfloat16).float()
    x = case.xs[rank]
    return moe_reference(x, case.ids[rank], case.weights[rank], lambda e, r: r.float() @ mats[e])


def test_graph_style_meter_counts_only_real_rows(ranks) -> None:
    cases, results = ranks
    case = cases[0]
    for rank in range(WORLD):
        got = _by_phase(results[rank]["_graph_style"]["meter"])
        pairs = [expert_pairs(_first(case, n), rank) for n in STEPS]
        assert got["dispatch"]["bytes"] == sum(pairs) * BF16_ROW
        assert got["combine"]["count"] == len(STEPS)


def test_graph_safe_where_decode_takes_the_masked_pair(ranks) -> None:
    _, results = ranks
    for rank in range(WORLD):
        assert results[rank]["_graph_safe"] == {"normal": False, "low_latency": True, "auto": True}


def test_host_sync_guard_catches_a_sync() -> None:
    """The guard the graph-style steps run under does see a host read (and lifts for the
    stand-in)."""
    guard = HostSyncGuard()
    t = torch.ones(3)
    with guard.active():
        with pytest.raises(AssertionError, match="item"):
            t.sum().item()
        with pytest.raises(AssertionError, match="__int__"):
            int(t[0])
        with pytest.raises(AssertionError, match="__getitem__"):
            t[t > 0]
        assert guard.allow(lambda: t.sum().item())() == 3.0
        t[torch.tensor([0, 1])]  # an integer index sizes nothing from device data
    assert t.sum().item() == 3.0


def test_meter_histogram_buckets_follow_prometheus_le() -> None:
    """An observation equal to a bound falls in that bound's bucket; past the last, +Inf."""
    totals = PhaseTotals()
    totals.add(DISPATCH_LATENCY_BUCKETS[0], 10)
    totals.add(DISPATCH_LATENCY_BUCKETS[-1] * 2, 10)
    assert totals.buckets[0] == 1 and totals.buckets[-1] == 1 and sum(totals.buckets) == 2
    assert (totals.bytes, totals.count) == (20, 2)


def test_meter_on_cpu_reads_device_counts_only_at_snapshot() -> None:
    """Rows given as a tensor are summed at stop and read at snapshot (not on the call)."""
    m = DispatchMeter(rank=0)
    counts = torch.tensor([3, 0, 2], dtype=torch.int32)
    guard = HostSyncGuard()
    with guard.active():
        m.stop(m.start(counts), "dispatch", "low_latency", counts, 100)
    counts.zero_()  # a later step reusing the buffer does not change what was recorded
    (phase,) = m.snapshot()["phases"]
    assert (phase["bytes"], phase["count"]) == (500, 1)
