"""The planner's DeepEP size formulas against the built ``deep_ep`` library's own hints
(``Buffer.get_low_latency_rdma_size_hint``, the NVLink hint of its recommended configs),
over the layouts the engine uses. Needs the wheel ``benchmarks/deepep/build.sh`` makes."""

from __future__ import annotations

import pytest

from dsv3serve.parallel.deepep_sizes import (
    NORMAL_BUFFER_FLOOR,
    low_latency_rdma_bytes,
    normal_nvl_bytes,
)

pytestmark = pytest.mark.gpu
deep_ep = pytest.importorskip("deep_ep")


@pytest.mark.parametrize("tokens", [1, 16, 128, 256, 511])
@pytest.mark.parametrize(
    ("hidden", "experts", "ranks"), [(7168, 256, 2), (7168, 288, 8), (4096, 64, 4)]
)
def test_low_latency_size_equals_deepeps_hint(tokens, hidden, experts, ranks) -> None:
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, ranks, experts)
    assert low_latency_rdma_bytes(tokens, hidden, experts) == hint


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_normal_size_equals_deepeps_hint(ranks, hidden) -> None:
    cfgs = (deep_ep.Buffer.get_dispatch_config, deep_ep.Buffer.get_combine_config)
    hints = [c(ranks).get_nvl_buffer_size_hint(2 * hidden, ranks) for c in cfgs]
    assert normal_nvl_bytes(hidden, ranks) == max(NORMAL_BUFFER_FLOOR, *hints)
