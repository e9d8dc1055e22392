"""``dsv3serve serve``: start a local Ray cluster and the app from a deploy file."""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from typing import NoReturn

import yaml

from dsv3serve.json_types import JSONObject, JSONValue, json_int, json_object, json_str
from router.api.admission import admission_limit
from router.api.proxy_admission import PROXY_ADMISSION_ENV
from router.api.proxy_middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from router.config import ConfigError, ServingConfig, app_args, deploy_applications
from router.launch_cluster import patient_node_lookup
from router.launch_start import (
    APP_START_S,
    PROXY_START_S,
    StartupError,
    deploy_app,
    say,
    start_serve,
    use_patient_proxy_checks,
    wait_running,
)
from router.launch_stop import graceful_bound_s, start_drain_board, stop_and_exit
from router.launch_usage import APP_NAME, check, check_grpc, usage_text

GRPC_SERVICER = "router.api.grpc_proxy.add_generation_servicer"
DEFAULT_GRPC_PORT = 9000


def local_pd_config() -> JSONObject:
    """The embedded default: deploy/local-pd.yaml (tiny model, CPU, 1 prefill + 1 decode)."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "grpc_options": {"port": DEFAULT_GRPC_PORT, "grpc_servicer_functions": [GRPC_SERVICER]},
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
                        "num_replicas": 2,
                        "max_in_flight": 256,
                        "policy": "rank_aware",
                    },
                },
            }
        ],
    }


def load_deploy_file(path: Path | None) -> JSONObject:
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
    for app in deploy_applications(data):
        try:
            ServingConfig.parse(app_args(app))
        except ConfigError as exc:
            raise ConfigError(f"{where}: application {app.get('name')!r}: {exc}") from None
    return data


def grpc_options(data: JSONObject, grpc_port: int | None = None) -> JSONObject | None:
    """The deploy file's ``grpc_options`` (``grpc_port`` replacing its port); None: no gRPC.

    Serve starts its gRPC proxy only when servicer functions are listed; it listens on
    every interface (Ray has no host option for it), so set an API key where that matters.
    """
    options = dict(json_object(data.get("grpc_options") or {}, "grpc_options"))
    if not options.get("grpc_servicer_functions"):
        return None
    options.setdefault("port", DEFAULT_GRPC_PORT)
    if grpc_port is not None:
        options["port"] = grpc_port
    return options


# Ray replaces a loopback node address given to ray.init with a routable one, and then
# binds GCS, raylet, workers and agents to every interface; with this flag off (Ray's
# single-machine mode, the default on macOS and Windows) the node address stays
# 127.0.0.1 and all of them bind to loopback. Read when ray is first imported.
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
LOOPBACK = "127.0.0.1"


def use_loopback_ray() -> None:
    """Make the local Ray cluster that ``start`` begins bind to loopback only; call
    before ray is imported (``run`` does)."""
    os.environ.update(LOOPBACK_RAY_ENV)


def use_proxy_middleware(admission: int | None = None) -> None:
    """Have Serve's HTTP proxy run our middlewares (``router/api/proxy_middleware.py``):
    cut event streams end with an error event, and with ``admission`` (a budget from
    :func:`~router.api.admission.admission_limit`) the door refuses past it at once. Call
    before ``ray.init`` starts the local cluster: the raylet inherits this process's
    environment, and the proxy actor the raylet's."""
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK
    if admission is None:
        os.environ.pop(PROXY_ADMISSION_ENV, None)
    else:
        os.environ[PROXY_ADMISSION_ENV] = str(admission)


def _check_loopback_node() -> None:
    import ray

    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        raise RuntimeError(
            f"expected the local Ray node on {LOOPBACK}, found {address}: ray was imported "
            "before router.launch.use_loopback_ray() set "
            + ", ".join(f"{k}={v}" for k, v in LOOPBACK_RAY_ENV.items())
        )


def http_options(data: JSONObject, port: int | None = None) -> JSONObject:
    """The deploy file's ``http_options`` (Serve's: ``keep_alive_timeout_s``,
    ``request_timeout_s``, ...) on loopback unless it names a host; ``port`` replaces
    its port."""
    given = json_object(data.get("http_options") or {}, "http_options")
    options: JSONObject = {"host": LOOPBACK, "port": 8000}
    options.update(given)
    if port is not None:
        options["port"] = port
    return options


def init_local_ray(admission: int | None = None) -> None:
    """Start a local Ray cluster with every Ray port (GCS, raylet, workers, agents) on
    loopback, no dashboard, our proxy middleware (``use_proxy_middleware``, with the
    door's budget ``admission``) and patient proxy readiness checks
    (``use_patient_proxy_checks``); raises RuntimeError when it could not be kept on
    loopback, StartupError when it did not start (its node gets ``NODE_START_S`` to
    register with the GCS: ``launch_cluster.patient_node_lookup``)."""
    use_loopback_ray()
    use_proxy_middleware(admission)
    use_patient_proxy_checks()
    import ray

    try:
        with patient_node_lookup():
            ray.init(
                num_cpus=max(os.cpu_count() or 1, 4),
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                ignore_reinit_error=True,
            )
    except Exception as exc:  # Ray raises a bare Exception when its node is late
        raise StartupError(f"the local Ray cluster did not start: {exc}") from exc
    _check_loopback_node()


def start(
    data: JSONObject,
    port: int | None = None,
    grpc_port: int | None = None,
    app_bound_s: float = APP_START_S,
) -> str:
    """Start a local Ray cluster (``init_local_ray``), HTTP (on loopback unless the file
    names a host), gRPC when the file has ``grpc_options``, and every app; returns the
    HTTP URL once Serve's proxy is HEALTHY (``start_serve``, within ``PROXY_START_S`` or
    ``app_bound_s`` if less) and every app RUNNING (each within ``app_bound_s``).

    Raises StartupError naming what did not start within its bound."""
    apps = deploy_applications(data)
    configs = [ServingConfig.parse(app_args(app)) for app in apps]
    init_local_ray(admission_limit(cfg.router for cfg in configs))
    from router.app import build_app

    http = http_options(data, port)
    start_drain_board()
    took = start_serve(http, grpc_options(data, grpc_port), min(PROXY_START_S, app_bound_s))
    say(f"Serve's proxy is up ({took:.0f} s); starting the app")
    autoscaled: list[JSONObject] = []
    for app, cfg in zip(apps, configs, strict=True):
        if cfg.slo is not None:
            autoscaled.append(app)
            continue
        name = json_str(app.get("name", APP_NAME), "name")
        route_prefix = json_str(app.get("route_prefix", "/"), "route_prefix")
        deploy_app(build_app(cfg), name, route_prefix, app_bound_s)
    if autoscaled:
        deploy_autoscaled(autoscaled, app_bound_s)
    return f"http://{http['host']}:{http['port']}"


def deploy_autoscaled(apps: list[JSONObject], bound_s: float = APP_START_S) -> None:
    """Deploy application entries whose ``args`` set ``slo`` through one Serve deploy
    config (Ray 2.60 takes an application-level ``autoscaling_policy`` only there; a
    later config replaces these apps), each with its policy filled in
    (``router.autoscale.app``); wait until they run.

    Raises StartupError when one fails to deploy or is not running within ``bound_s``."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from router.autoscale.app import with_autoscaling_policy

    entries = [
        {"name": APP_NAME, "route_prefix": "/"} | with_autoscaling_policy(app) for app in apps
    ]
    client = _get_global_client()
    if client is None:
        raise RuntimeError("deploy_autoscaled: expected a running Serve controller, found none")
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": entries}))
    for entry in entries:
        wait_running(entry["name"], bound_s)


def check_line(url: str, data: JSONObject, grpc_port: int | None) -> str:
    """``--check``: one chat completion over HTTP, and the gRPC Health when gRPC is on."""
    from router.api.auth import APIKeyAuth

    first = deploy_applications(data)[0]
    settings = ServingConfig.parse(first["args"]).router
    key = APIKeyAuth.from_env(settings.api_key_env).key
    api_key = key.decode() if key else "none"
    line = f"dsv3serve is up at {url}; one chat completion: "
    line += repr(check(url, settings.served_model_name, api_key))
    grpc = grpc_options(data, grpc_port)
    if grpc is not None:
        port = json_int(grpc["port"], "grpc port")
        status = check_grpc(port, json_str(first.get("name", APP_NAME), "name"), api_key)
        line += f"; gRPC Health on port {grpc['port']}: {status!r}"
    return line


def with_reasoning_parser(data: JSONObject, parser: str | None) -> JSONObject:
    """``data`` with ``router.reasoning_parser`` set on every app (None: as the file says)."""
    if parser is None:
        return data
    apps: list[JSONValue] = []
    for app in deploy_applications(data):
        args = dict(app_args(app))
        args["router"] = json_object(args.get("router") or {}, "router") | {
            "reasoning_parser": parser
        }
        apps.append(dict(app) | {"args": args})
    return dict(data) | {"applications": apps}


def run(
    path: Path | None,
    port: int | None,
    check_only: bool,
    grpc_port: int | None = None,
    reasoning_parser: str | None = None,
    start_bound_s: float = APP_START_S,
) -> NoReturn:
    """Serve until Ctrl-C or SIGTERM (or, with ``check_only``, answer one request), then
    stop the local cluster and exit the process (``stop_and_exit``): 0, or 1 after an error
    (one line naming what did not start, when Serve's proxy or an app was not up within
    its bound: ``start_bound_s``, at most ``PROXY_START_S`` for the proxy).

    Raises ConfigError, before anything starts, for an invalid deploy file.
    """
    use_loopback_ray()  # before anything imports ray
    data = with_reasoning_parser(load_deploy_file(path), reasoning_parser)
    first = deploy_applications(data)[0]
    model = ServingConfig.parse(first["args"]).router.served_model_name
    grpc = grpc_options(data, grpc_port)
    bound_s = graceful_bound_s(data)
    code = 1
    try:
        url = start(data, port, grpc_port, start_bound_s)
        # SIGTERM stops it as Ctrl-C does; set after ray.init, which installs a handler
        # of its own that aborts the process.
        signal.signal(signal.SIGTERM, _interrupt)
        if check_only:
            print(check_line(url, data, grpc_port))
        else:
            app = json_str(first.get("name", APP_NAME), "name")
            port = json_int(grpc["port"], "grpc port") if grpc else None
            print(usage_text(url, model, port, app), flush=True)
            while True:
                time.sleep(3600)
        code = 0
    except KeyboardInterrupt:
        code = 0
    except StartupError as exc:
        say(f"not started: {exc}")
    except Exception:
        traceback.print_exc()
    stop_and_exit(code, bound_s)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
