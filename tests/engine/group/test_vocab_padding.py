"""A vocabulary that does not divide over the lm_head's ranks (1,001 tokens over 2): the
split is padded as vLLM and SGLang pad it (each rank ``ceil(V / parts)`` rows, zero past
the end, the logits cut back to V), and sharded groups over real gloo processes give the
single-rank engine's greedy tokens on the scripted workload. It was refused before
(``vocab_size 1001 does not divide over 2 ranks``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from group_scenario import DP_KV_TOKENS, LAYOUTS, SCENARIO_ENGINE, run_scenario

from dsv3serve.engine.config import EngineConfig
from dsv3serve.engine.engine import Engine
from dsv3serve.engine.llm import LLM
from dsv3serve.model.tiny import make_tiny_checkpoint
from dsv3serve.parallel.shard import Split

ODD_VOCAB = 1001  # 7 x 11 x 13; the scenario's prompt ids stay below 905


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("odd-vocab") / "tiny"
    make_tiny_checkpoint(path, fp8=False, overrides={"vocab_size": ODD_VOCAB})
    return path


@pytest.fixture(scope="module")
def reference(odd_vocab_dir: Path) -> dict[str, list[int]]:
    return run_scenario(Engine(EngineConfig(model=str(odd_vocab_dir), **SCENARIO_ENGINE)))


@pytest.mark.parametrize("layout", ["tp2", "dp2-ep2"])
def test_padded_vocab_split_matches_one_rank(layout: str, odd_vocab_dir: Path, reference) -> None:
    args = {**SCENARIO_ENGINE, **LAYOUTS[layout]}
    if args.get("enable_dp_attention"):
        args["num_kv_tokens"] = DP_KV_TOKENS[args["dp_size"]]
    with LLM(str(odd_vocab_dir), **args) as llm:
        tokens = run_scenario(llm.engine)
    assert tokens == reference


def test_padded_split_slices_and_shapes() -> None:
    last = Split(0, 1, 2, padded=True)
    assert last.local_shape((1001, 8)) == (501, 8)
    assert last.index((1001, 8))[0] == slice(501, 1001)  # 500 rows read, one zero row
    assert Split(0, 0, 2, padded=True).index((1001, 8))[0] == slice(0, 501)
