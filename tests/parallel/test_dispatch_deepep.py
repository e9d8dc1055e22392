"""The DeepEP backend's glue, over ``fake_deep_ep`` on real spawned gloo ranks (2).

DeepEP itself needs GPUs with NVLink / NVSHMEM, so ``tests/support/fake_deep_ep.py`` stands
in for ``deep_ep`` (same calls and return tuples; low-latency padding is NaN). Each case runs
through the all-to-all backend and the DeepEP glue in every mode; all must equal the
single-rank reference ``moe_reference`` (fresh random inputs each session; seed in messages).

Tolerances: bf16 rows, atol = rtol = 2e-2 against the float32 reference (each rank's part
rounded to bf16 before combine, the sum once more after; the low-latency combine sums the
weighted parts itself). FP8 dispatch is compared with the reference on the same rows
quantised per token per 128 channels and dequantised to bf16, as they arrive (same
tolerance); against unquantised rows the e4m3 error alone reaches ~0.15 absolute here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepep_util import run_deepep_ranks
from dispatch_util import Case, experts_fn, make_case
from fresh_seed import session_seed

from dsv3serve.kernels.fp8_ref import FP8_DTYPE, dequant_per_token_group, quant_per_token_group
from dsv3serve.moe.sharded import DEEPEP_FUSION_REASON, fusion_blocked_reason
from dsv3serve.parallel.config import LayoutError, ParallelConfig
from dsv3serve.parallel.dispatch import DeepEPOptions, DispatchBackendUnavailable, create_dispatcher
from dsv3serve.parallel.dispatch_ref import moe_reference
from dsv3serve.parallel.shard import RankLayout

SEED = session_seed()
BF16 = torch.bfloat16
MODES = ("a2a", "normal", "low_latency", "auto_prefill", "auto_decode")


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(SEED)
    return [
        make_case("uniform", g, [13, 9], BF16),
        make_case("all_to_rank0", g, [8, 5], BF16, experts=range(0, 8)),
        make_case("all_to_rank1", g, [6, 16], BF16, experts=range(8, 16)),
        make_case("rank1_empty", g, [10, 0], BF16),
        make_case("all_empty", g, [0, 0], BF16),
        make_case("fp8_dispatch", g, [12, 7], BF16, payload_dtype=FP8_DTYPE),
    ]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Case], list[dict]]:
    cases = _cases()
    return cases, run_deepep_ranks(cases, 2, tmp_path_factory.mktemp("deepep"), SEED)


def _want(case: Case, rank: int, quantised: bool) -> torch.Tensor:
    """The reference; with ``quantised``, on rows rounded as FP8 dispatch sends them
    (e4m3 per token per 128 channels, dequantised to bf16 on arrival)."""
    x, ids, w = case.xs[rank], case.ids[rank], case.weights[rank]
    if quantised and x.shape[0]:
        x = dequant_per_token_group(*quant_per_token_group(x)).to(x.dtype)
    return moe_reference(x, ids, w, experts_fn(case.mats))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [c.name for c in _cases()])
def test_deepep_modes_match_reference(ranks, name: str, mode: str) -> None:
    cases, results = ranks
    case = next(c for c in cases if c.name == name)
    quantised = case.payload_dtype is not None and mode != "a2a"
    for r, res in enumerate(results):
        got, want = res[name][mode], _want(case, r, quantised)
        assert got.shape == want.shape and got.dtype == BF16, (name, mode, r)
        where = f"{name}/{mode}/rank{r} seed {SEED}"
        torch.testing.assert_close(
            got.float(), want, atol=2e-2, rtol=2e-2, msg=lambda m, w=where: f"{w}: {m}"
        )


def test_auto_cleans_low_latency_buffer_after_normal(ranks) -> None:
    _, results = ranks
    # one clean after the self-check's normal round trip and one after the prefill batch
    assert all(int(res["uniform"]["auto_cleans"]) == 2 for res in results)
    # prepare_graph (before a capture or replay) did the second one, outside any graph
    assert all(int(res["uniform"]["auto_cleans_before_decode"]) == 2 for res in results)


def test_run_dispatched_with_real_experts_both_phases(ranks) -> None:
    _, results = ranks
    for r, res in enumerate(results):
        moe = res["_moe"]
        for phase in ("prefill", "decode"):
            torch.testing.assert_close(
                moe[phase].float(), moe["want"].float(), atol=1e-4, rtol=1e-2,
                msg=lambda m, w=f"{phase}/rank{r} seed {SEED}": f"{w}: {m}",
            )  # fmt: skip


def test_close_releases_the_buffer_explicitly_on_every_rank(ranks) -> None:
    """DeepEP's implicit release (the destructor) is a barrier with the other ranks, which
    hung the first rank to exit on two H100s; close() on every rank at STOP replaces it."""
    _, results = ranks
    assert [res["_close"] for res in results] == [{"explicit": True, "destroyed": True}] * 2


def test_self_check_refuses_a_deep_ep_that_returns_wrong_data(ranks) -> None:
    _, results = ranks
    for res in results:
        for key, mode in (("corrupt_normal", "normal"), ("corrupt_ll", "low_latency")):
            msg = res["_refusals"][key]
            assert msg.startswith("DispatchBackendUnavailable"), msg
            assert f"self-check failed ({mode} mode round trip differs" in msg
            assert "benchmarks/deepep/build.sh" in msg and "moe_a2a_backend 'none'" in msg


def test_glue_refusals(ranks) -> None:
    _, results = ranks
    for res in results:
        ref = res["_refusals"]
        assert "expected at most max_tokens_per_rank 16" in ref["too_many"]
        assert "needs NVSHMEM_QP_DEPTH >= 1026, found 1024" in ref["qp_depth"]
        assert "expects bfloat16 hidden states, got torch.float32" in ref["fp32"]
        assert "sends every batch masked" in ref["flat_under_ll"]
        assert "has no low-latency buffer" in ref["masked_under_normal"]


# --- config errors (no process group needed) ------------------------------------------


def _cfg(**kw: object) -> ParallelConfig:
    return ParallelConfig(
        tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2, moe_a2a_backend="deepep", **kw
    )


def test_refused_when_deep_ep_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "deep_ep", None)  # import raises ImportError
    with pytest.raises(DispatchBackendUnavailable, match=r"deep_ep does not import \(Module") as e:
        create_dispatcher(_cfg(), 16, 0, deepep=DeepEPOptions(hidden=128))
    assert "benchmarks/deepep/build.sh" in str(e.value) and "nvidia-nvshmem-cu13" in str(e.value)


def test_refused_without_options_or_with_loopback() -> None:
    with pytest.raises(LayoutError, match=r"needs DeepEPOptions"):
        create_dispatcher(_cfg(), 16, 0)
    with pytest.raises(LayoutError, match=r"loopback timing runs the all-to-all only"):
        create_dispatcher(_cfg(), 16, 0, loopback=True, deepep=DeepEPOptions(hidden=128))


def test_parallel_config_errors() -> None:
    with pytest.raises(ValueError, match=r"moe_a2a_backend 'deepep' needs ep_size > 1"):
        ParallelConfig(tp_size=2, moe_a2a_backend="deepep")
    with pytest.raises(ValueError, match=r"'deepep' needs enable_dp_attention: under TP"):
        ParallelConfig(tp_size=2, ep_size=2, moe_a2a_backend="deepep")
    with pytest.raises(ValueError, match=r"deepep_mode 'low_latency' is only used with"):
        ParallelConfig(tp_size=2, deepep_mode="low_latency")
    with pytest.raises(ValueError, match=r"deepep_mode"):
        _cfg(deepep_mode="fast")


def test_shared_expert_fusion_off_under_deepep() -> None:
    assert fusion_blocked_reason(RankLayout(_cfg(), 0)) == DEEPEP_FUSION_REASON
    assert "SGLang" in DEEPEP_FUSION_REASON


def test_fake_is_named_as_fake() -> None:
    import fake_deep_ep

    assert fake_deep_ep.make_module().__name__ == "fake_deep_ep"
    assert Path(fake_deep_ep.__file__).parent.name == "support"


def test_moe_round_outputs_are_not_negligible(ranks) -> None:
    """Keeps the tolerance above meaningful: the outputs are far above its atol."""
    _, results = ranks
    assert all(float(res["_moe"]["want"].float().abs().mean()) > 1e-3 for res in results)
