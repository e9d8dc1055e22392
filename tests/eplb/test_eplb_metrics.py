"""The hot-expert-ratio gauge through a real Prometheus registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from dsv3serve.metrics import EplbHotRatioCollector, Identity


def test_hot_ratio_gauge_per_layer() -> None:
    ratios: list[float] = []
    registry = CollectorRegistry()
    registry.register(EplbHotRatioCollector(Identity("decode", "d-0", "tiny"), lambda: ratios))
    assert b"eplb_hot_expert_ratio" not in generate_latest(registry)  # before a rebalance
    ratios[:] = [3.5, 1.25]
    text = generate_latest(registry).decode()
    assert (
        'dsv3serve:eplb_hot_expert_ratio{layer="0",model="tiny",replica="d-0",role="decode"} 3.5'
        in text
    )
    assert 'layer="1"' in text and "1.25" in text
