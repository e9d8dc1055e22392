"""``dsv3serve serve``: start a local Ray cluster and the app from a deploy file."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from router.config import ConfigError, ServingConfig

APP_NAME = "dsv3serve"


def local_pd_config() -> dict[str, Any]:
    """The embedded default: deploy/local-pd.yaml (tiny model, CPU, 1 prefill + 1 decode)."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": "router.app:build_app",
                "args": {
                    "mode": "pd",
                    "engine": {
                        "model": "tiny",
                        "device": "cpu",
                        "page_size": 16,
                        "num_kv_tokens": 16384,
                        "fp8_act_quant": False,
                    },
                    "prefill": {"num_replicas": 1, "num_cpus": 1},
                    "decode": {"num_replicas": 1, "num_cpus": 1},
                    "kv_connector": "shm",
                    "kv_lease_s": 30,
                    "torch_threads": 1,
                    "router": {
                        "served_model_name": "deepseek-v3-tiny",
                        "max_in_flight": 256,
                        "policy": "prefix_affinity",
                    },
                },
            }
        ],
    }


def load_deploy_file(path: Path | None) -> dict[str, Any]:
    """A Serve deploy config (Ray's ServeDeploySchema) whose apps are ours, validated.

    Raises ConfigError naming the file and the bad field.
    """
    from ray.serve.schema import ServeDeploySchema

    data = local_pd_config() if path is None else yaml.safe_load(Path(path).read_text())
    where = "the embedded default" if path is None else str(path)
    try:
        ServeDeploySchema.model_validate(data)
    except Exception as exc:  # pydantic (v1 or v2) ValidationError
        raise ConfigError(f"{where}: not a valid Serve deploy config: {exc}") from None
    for app in data["applications"]:
        try:
            ServingConfig.parse(app.get("args") or {})
        except ConfigError as exc:
            raise ConfigError(f"{where}: application {app.get('name')!r}: {exc}") from None
    return data


def start(data: dict[str, Any], port: int | None = None) -> str:
    """Start a local Ray cluster (loopback only, no dashboard) and every app; returns URL."""
    import ray
    from ray import serve

    from router.app import build_app

    http = dict(data.get("http_options") or {})
    if port is not None:
        http["port"] = port
    ray.init(
        num_cpus=max(os.cpu_count() or 1, 4),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        ignore_reinit_error=True,
    )
    serve.start(
        http_options={"host": http.get("host", "127.0.0.1"), "port": http.get("port", 8000)}
    )
    for app in data["applications"]:
        serve.run(
            build_app(ServingConfig.parse(app.get("args") or {})),
            name=app.get("name", APP_NAME),
            route_prefix=app.get("route_prefix", "/"),
        )
    return f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"


def usage_text(url: str, model: str) -> str:
    """What to print once the app is up: the URL and example calls."""
    body = (
        f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], '
        '"max_tokens": 32}'
    )
    return (
        f"dsv3serve is up at {url}\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n\n"
        "  python -c \"from openai import OpenAI; c = OpenAI(base_url='" + url + "/v1', "
        "api_key='none'); print(c.chat.completions.create(model='" + model + "', "
        "messages=[{'role': 'user', 'content': 'Hello!'}], max_tokens=32)"
        '.choices[0].message.content)"\n\n'
        "Ctrl-C stops it."
    )


def check(url: str, model: str) -> str:
    """One chat completion through the app with the openai client; returns its text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello, who are you?"}],
        max_tokens=16,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def run(path: Path | None, port: int | None, check_only: bool) -> int:
    """Serve until interrupted (or, with ``check_only``, answer one request and stop)."""
    import ray
    from ray import serve

    data = load_deploy_file(path)
    model = ServingConfig.parse(data["applications"][0]["args"]).router.served_model_name
    url = start(data, port)
    try:
        if check_only:
            print(f"dsv3serve is up at {url}; one chat completion: {check(url, model)!r}")
            return 0
        print(usage_text(url, model), flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
