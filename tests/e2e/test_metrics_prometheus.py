"""Metrics end to end: the PD app on real Ray, a real Prometheus scraping it, every
dashboard panel's query answered with data, and promtool on our exposition.

Decode runs as a DP-attention group with the experts split by EP over 2 ranks (rank 1 a
Ray actor), so the MoE dispatch panels have every rank's series; the tiny checkpoint is the
bf16 one in float32, as in tests/e2e/test_worker_group.py.

Needs Debian's ``prometheus`` package (the README's install command installs it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from http_util import spare_port
from serving_util import TINY_ENGINE, ServeCluster, free_port_pair, running_app, serving_config

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
APP = "metrics"
SUBSTITUTIONS = {"$__rate_interval": "1m", "$model": "tiny"}
COLON_LINT = "metric names should not contain ':'"
DP2_EP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2}

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Debian's prometheus package"
)


def panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expression with template variables substituted). The
    autoscaling panels are left out: their series exist only for an app whose config sets
    ``slo`` (this stack's fixed 1 + 1 app has none)."""
    out = []
    for path in sorted(GRAFANA.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            if panel["title"].startswith("Autoscaling:"):
                continue
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in SUBSTITUTIONS.items():
                    expr = expr.replace(var, value)
                out.append((path.name, panel["title"], expr))
    return out


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_bf16_dir: Path, serve_cluster: ServeCluster
) -> Iterator[dict[str, str]]:
    metrics_port = free_port_pair()  # router replica k binds metrics_port + k
    prom_port = spare_port()
    router = {"served_model_name": "tiny", "metrics_port": metrics_port, "num_replicas": 2}
    engine = {**TINY_ENGINE, "model": str(tiny_bf16_dir), "dtype": "float32"}
    decode = {"num_cpus": 0.5, "engine": DP2_EP2}
    cfg = serving_config(mode="pd", engine=engine, decode=decode, router=router)
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: dsv3serve\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}', "
        f"'127.0.0.1:{metrics_port + 1}']}}]\n"
    )
    with running_app(serve_cluster.base, APP, cfg) as url:
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            yield {
                "app": url,
                "prom": f"http://127.0.0.1:{prom_port}",
                "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
            }
        finally:
            prom.terminate()
            prom.wait(timeout=30)


def query(prom: str, expr: str) -> list[dict]:
    reply = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def wait_for_target(prom: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if sum(r["value"][1] == "1" for r in query(prom, 'up{job="dsv3serve"}')) == 2:
                return  # both router replicas
        except (httpx.HTTPError, ValueError):  # not up, or starting: a 503 in plain text
            pass
        time.sleep(0.5)
    raise AssertionError("Prometheus never scraped both router replicas' metrics endpoints")


def send_traffic(url: str) -> None:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(6):
        messages = [{"role": "user", "content": f"Shared system prefix. Question {i % 2}."}]
        stream = c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, stream=True, temperature=0
        )
        for _ in stream:
            pass
    bad = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny"}, timeout=30)
    assert bad.status_code == 400


@pytest.fixture(scope="module")
def scraped(stack: dict[str, str]) -> dict[str, str]:
    wait_for_target(stack["prom"])
    time.sleep(2)  # a scrape before the traffic, so rates have a base
    send_traffic(stack["app"])
    time.sleep(4)  # a few scrapes after it
    return stack


@pytest.mark.parametrize(("dashboard", "title", "expr"), panel_queries(), ids=lambda v: str(v)[:60])
def test_every_dashboard_query_returns_data(
    scraped: dict[str, str], dashboard: str, title: str, expr: str
) -> None:
    result = query(scraped["prom"], expr)
    values = [float(r["value"][1]) for r in result]
    assert values, f"{dashboard} / {title}: no series for {expr}"
    assert any(v == v for v in values), f"{dashboard} / {title}: only NaN for {expr}"


def test_traffic_is_counted_by_role(scraped: dict[str, str]) -> None:
    prom = scraped["prom"]
    by_role = {
        r["metric"]["role"]: float(r["value"][1])
        for r in query(prom, "sum by (role) (dsv3serve:generation_tokens_total)")
    }
    # Both router replicas' counters add up; the workers' series come from router-0 only,
    # so they are not counted twice.
    assert by_role["router"] == by_role["decode"] == 6 * 8
    assert by_role["prefill"] == 0  # the prefill side samples one token, decode emits all
    ok = query(prom, 'sum(dsv3serve:requests_total{role="router", status="200"})')
    assert float(ok[0]["value"][1]) == 6
    replicas = query(prom, 'count by (replica) ({__name__=~"dsv3serve:.+", role="router"})')
    assert {r["metric"]["replica"] for r in replicas} == {"router-0", "router-1"}


def test_exposition_passes_promtool(scraped: dict[str, str]) -> None:
    text = httpx.get(scraped["metrics"], timeout=30).text
    assert 'role="prefill"' in text and 'role="decode"' in text and 'role="router"' in text
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    problems = [line for line in (done.stdout + done.stderr).splitlines() if COLON_LINT not in line]
    # Exit 1 is a parse error; 3 is lint only. Our only lint finding may be the colon of
    # the vLLM-style "dsv3serve:" namespace, which promtool reserves for recording rules.
    assert done.returncode in (0, 3) and not problems, problems


def _by_rank_phase(prom: str, expr: str) -> dict[tuple[str, str], float]:
    return {
        (r["metric"]["rank"], r["metric"]["phase"]): float(r["value"][1]) for r in query(prom, expr)
    }


def test_dispatch_metrics_come_from_every_decode_rank(scraped: dict[str, str]) -> None:
    """Rank 1 is another process (a Ray actor): its meters reach the exposition through
    rank 0's scrape-time call, labelled ``rank="1"``; both ranks ran every dispatch."""
    text = httpx.get(scraped["metrics"], timeout=30).text
    assert "dsv3serve:moe_dispatch_bytes_total{" in text and 'rank="1"' in text
    prom = scraped["prom"]
    sel = '{role="decode", mode="a2a"}'
    by = "sum by (rank, phase)"
    nbytes = _by_rank_phase(prom, f"{by} (dsv3serve:moe_dispatch_bytes_total{sel})")
    assert set(nbytes) == {(r, p) for r in ("0", "1") for p in ("dispatch", "combine")}
    assert all(v > 0 for v in nbytes.values()), nbytes
    calls = _by_rank_phase(
        prom, f"sum by (rank, phase) (dsv3serve:moe_dispatch_seconds_count{sel})"
    )
    assert calls[("0", "dispatch")] == calls[("1", "dispatch")] > 0, calls
    assert calls[("0", "combine")] == calls[("1", "combine")] == calls[("0", "dispatch")], calls
