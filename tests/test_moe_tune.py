"""The tuner's search space (the timing itself needs a GPU: ``python -m dsv3serve.moe.tune``)."""

from __future__ import annotations

import pytest

from dsv3serve.moe.tune import BLOCK_MS, main, tiles


@pytest.mark.parametrize("block_m", BLOCK_MS)
@pytest.mark.parametrize("fp8", [True, False])
def test_candidates_respect_the_kernel_contract(block_m: int, fp8: bool) -> None:
    gate_up, down = tiles(True, fp8, block_m), tiles(False, fp8, block_m)
    assert gate_up and down
    for t in gate_up + down:
        assert t.block_k == (128 if fp8 else 64)
        assert not t.swap_ab or block_m <= 64
    if fp8:  # one program quantises one 128-wide group of the intermediate
        assert {t.block_n for t in gate_up} == {128}


def test_refuses_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA"):
        main(["--tokens", "1"])
