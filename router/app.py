"""The Ray Serve application: the router ingress and one deployment per worker replica.

``build_app`` is the Serve app builder named by the configs in ``deploy/``
(``import_path: router.app:build_app``); its ``args`` are a :class:`ServingConfig`.
The router answers OpenAI HTTP and, through Serve's gRPC proxy, ``dsv3serve.v1.Generation``
(``router/proto/generate.proto``; enabled by the deploy file's ``grpc_options``).
"""

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import RayServeException
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle

from dsv3serve.metrics import Identity, Metrics
from router.api.admission import REFUSAL_RETRY_AFTER_S, router_max_ongoing, serve_queue_limit
from router.api.auth import APIKeyAuth, unauthorized_response
from router.api.grpc_api import GenerationService
from router.api.grpc_api import Request as GrpcRequest
from router.api.openai_api import APIConfig, OpenAIServer, new_app
from router.api.proxy_admission import limit_from_env
from router.autoscale.app import (
    MembershipWatch,
    membership,
    worker_autoscaling,
    worker_count,
)
from router.autoscale.board import ack_leaving
from router.autoscale.metrics import AutoscaleMetrics
from router.config import RoleGroup, RouterSettings, ServingConfig
from router.drain import listen
from router.metered import MeteredBackend
from router.metrics_server import TEXT_FORMAT, MergedCollector, serve_metrics
from router.pd.backend import PDBackend
from router.pd.colocated import ColocatedBackend
from router.proto import generate_pb2 as pb
from router.routing.policy import ReplicaSet
from router.routing.rank_routing import rank_board
from workers.backend import GenerationBackend
from workers.deployments import EngineWorker
from workers.protocol import Role, WorkerInfo, decode

logger = logging.getLogger(__name__)

ROUTER_NAME = "router"
# Serve's check for a stopping replica's requests, which it first makes after one period
# (Serve's default is 2 s): an idle replica stops this much sooner (graceful stop's bound).
DRAIN_POLL_S = 0.25
ingress = new_app()


@dataclass(frozen=True)
class RouterRank:
    """Which router replica this is: Serve's replica rank, over all nodes and on its node."""

    rank: int
    local_rank: int

    @property
    def name(self) -> str:
        """The ``replica`` label of its metrics, e.g. ``router-1``."""
        return f"{ROUTER_NAME}-{self.rank}"


def router_rank() -> RouterRank:
    """This router replica's rank (Serve reuses a lost replica's rank for its replacement,
    so ranks stay below num_replicas); rank 0 outside a Serve replica or without one."""
    try:
        rank = serve.get_replica_context().rank
    except RayServeException:
        return RouterRank(0, 0)
    if rank is None:  # Serve gives every new replica one; never seen without
        return RouterRank(0, 0)
    return RouterRank(rank.rank, rank.local_rank)


def replica_name(role: Role, index: int) -> str:
    """The deployment name of one worker replica, e.g. ``prefill-0``."""
    return f"{role}-{index}"


def _utility(name: str) -> Callable[[OpenAIServer, Request], Awaitable[Response]]:
    """The ``UtilityAPI`` endpoint ``name`` of a server, for ``Router._v1`` (defined before
    the class: Serve pickles the class where it is decorated)."""

    async def endpoint(server: OpenAIServer, request: Request) -> Response:
        method: Callable[[Request], Awaitable[Response]] = getattr(server.utility, name)
        return await method(request)

    return endpoint


@serve.deployment(name=ROUTER_NAME, max_ongoing_requests=4096)
@serve.ingress(ingress)
class Router:
    """OpenAI-compatible HTTP and gRPC front ends over the PD or colocated backend."""

    def __init__(self, config_json: str, workers: dict[str, list[DeploymentHandle]]) -> None:
        self.cfg = ServingConfig.model_validate_json(config_json)
        self._workers = workers
        self._server: OpenAIServer | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._init_lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None
        settings = self.cfg.router
        rank = router_rank()
        self.metrics = Metrics(Identity("router", rank.name, settings.served_model_name))
        self.auth = APIKeyAuth.from_env(settings.api_key_env)
        self.grpc = GenerationService(self.server, self.auth, self.metrics)
        handles = [h for role in self.cfg.roles() for h in workers[role]]
        # GET /metrics on the API port (as vLLM and SGLang serve it): the answering
        # replica's series and every worker's, merged at each scrape.
        self.api_metrics = CollectorRegistry(auto_describe=False)
        self.api_metrics.register(MergedCollector(self.metrics.registry, handles))
        if settings.metrics_port is not None:
            # Every replica exposes its own counters; the first also merges the workers'
            # (once, so a sum over scrape targets counts each worker series once).
            serve_metrics(
                self.metrics.registry,
                handles if rank.rank == 0 else [],
                settings.metrics_host,
                settings.metrics_port + rank.local_rank,
            )

    async def server(self) -> OpenAIServer:
        """The HTTP logic, built on first use once a worker has reported its limits."""
        async with self._init_lock:
            if self._server is None:
                self._server = await self._build_server()
                self._drain_task = asyncio.create_task(self._listen(self._server))
        return self._server

    async def _listen(self, server: OpenAIServer) -> None:
        """Follow ``dsv3serve serve``'s graceful stop (``router/drain.py``), if it has one."""
        name = f"{router_rank().name}-{uuid.uuid4().hex[:8]}"
        try:
            await listen(name, server.drain, lambda: server.admission.in_flight)
        except Exception:
            logger.exception("router %s: following the graceful stop failed", name)

    async def _build_server(self) -> OpenAIServer:
        from dsv3serve.tokenizer.locate import tokenizer_dir
        from dsv3serve.tokenizer.tokenizer import Tokenizer

        roles = self.cfg.roles()
        infos = [decode(WorkerInfo, await self._workers[r][0].info.remote()) for r in roles]
        info = infos[-1]
        sets = {
            role: ReplicaSet(
                [replica_name(role, i) for i in range(len(self._workers[role]))],
                self._workers[role],
            )
            for role in roles
        }
        await self._follow_members(sets)
        settings = self.cfg.router
        tokenizer = await asyncio.to_thread(
            Tokenizer.from_dir, tokenizer_dir(self.cfg.engine.model)
        )
        await asyncio.to_thread(tokenizer.warm_up)  # off the event loop
        backend: GenerationBackend
        if self.cfg.mode == "pd":
            backend = PDBackend(
                sets["prefill"],
                sets["decode"],
                settings,
                info.page_size,
                tokenizer,
                self.metrics,
                overlap=self.cfg.kv_transfer_overlap,
            )
        else:
            colocated = sets["colocated"]
            board = rank_board(colocated, settings, info.page_size)
            backend = ColocatedBackend(colocated, board)
        backend = MeteredBackend(backend, self.metrics)
        api = APIConfig(
            served_model_name=settings.served_model_name,
            max_model_len=min(i.max_model_len for i in infos),  # what every role can hold
            max_in_flight=settings.max_in_flight,
            max_body_bytes=settings.max_body_bytes,
            body_read_timeout_s=settings.body_read_timeout_s,
            max_json_depth=settings.max_json_depth,
            vocab_size=info.vocab_size,
            reasoning_parser=settings.reasoning_parser,
            special_tokens_in_content=settings.special_tokens_in_content,
        )
        return OpenAIServer(api, tokenizer, backend)

    async def _follow_members(self, sets: dict[Role, ReplicaSet]) -> None:
        """Autoscaled: start with the deployments Serve starts (the first num_replicas of
        each role) and follow Serve's running replicas, less those the policy marks
        leaving, from then on."""
        slo = self.cfg.slo
        if slo is None:
            return
        initial = {
            replica_name(role, i): int(i < getattr(self.cfg, role).num_replicas)
            for role in self.cfg.roles()
            for i in range(len(self._workers[role]))
        }
        metrics = AutoscaleMetrics(self.metrics.registry, self.metrics.identity, slo)
        context = serve.get_replica_context()
        app, me = context.app_name, context.replica_id.unique_id
        watch = MembershipWatch(
            {role: replicas for role, replicas in sets.items()},
            lambda: membership(app),
            slo.membership_period_s,
            metrics,
            lambda version: ack_leaving(app, me, version),
        )
        watch.apply(initial)
        await watch.step()  # the policy's leaving set applies before the first choice
        self._watch = asyncio.get_running_loop().create_task(watch.run())

    def _count(self, response: Response) -> Response:
        self.metrics.answered("http", response.status_code)
        return response

    async def _v1(
        self, request: Request, endpoint: Callable[[OpenAIServer, Request], Awaitable[Response]]
    ) -> Response:
        """An inference route: the API key first (when one is set), then ``endpoint``."""
        refusal = self.auth.refusal(request.headers.get("authorization"))
        if refusal is not None:
            return self._count(unauthorized_response(refusal))
        return self._count(await endpoint(await self.server(), request))

    # ---- HTTP: the OpenAI API ------------------------------------------------------------
    @ingress.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._v1(request, OpenAIServer.chat_completions)

    @ingress.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._v1(request, OpenAIServer.completions)

    @ingress.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._v1(request, OpenAIServer.models)

    @ingress.get("/v1/models/{model:path}")
    async def model(self, request: Request) -> Response:
        return await self._v1(request, _utility("model"))

    @ingress.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._v1(request, _utility("tokenize"))

    @ingress.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._v1(request, _utility("detokenize"))

    @ingress.api_route("/health", methods=["GET", "HEAD"])
    async def health(self, request: Request) -> Response:
        return self._count(await (await self.server()).health(request))

    @ingress.get("/version")
    async def version(self, request: Request) -> Response:
        return await (await self.server()).utility.version(request)

    @ingress.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        body = await asyncio.to_thread(generate_latest, self.api_metrics)
        return Response(body, media_type=TEXT_FORMAT)

    # ---- gRPC: dsv3serve.v1.Generation (Serve calls the method named like the RPC) ------
    async def Generate(
        self, request: GrpcRequest, grpc_context: RayServegRPCContext
    ) -> pb.GenerateResponse:
        return await self.grpc.complete(request, grpc_context)

    async def GenerateStream(
        self, request: GrpcRequest, grpc_context: RayServegRPCContext
    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        async with aclosing(self.grpc.stream(request, grpc_context)) as messages:
            async for message in messages:
                yield message

    # a chat request takes the same path (GenerationService tells the messages apart)
    ChatComplete = Generate
    ChatCompleteStream = GenerateStream

    async def Health(
        self, request: pb.HealthRequest, grpc_context: RayServegRPCContext
    ) -> pb.HealthResponse:
        return await self.grpc.health(grpc_context)


def _worker_app(cfg: ServingConfig, role: Role, index: int) -> Any:
    group = getattr(cfg, role)
    options: dict[str, Any] = {
        "name": replica_name(role, index),
        "ray_actor_options": {
            "num_cpus": group.num_cpus,
            "num_gpus": group.num_gpus,
            "resources": dict(group.resources),
        },
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
    }
    if cfg.slo is None:
        options["num_replicas"] = 1
    else:
        options |= worker_autoscaling(cfg, role, index)
    worker = cfg.worker_config(role)
    if worker.group_size > 1:
        options["placement_group_bundles"] = _bundles(group, worker.group_size)
        options["placement_group_strategy"] = "PACK"  # spans nodes only when one is full
    worker_cfg = worker.model_dump_json()
    # mypy keeps a decorated class's own type: EngineWorker is a Serve Deployment
    worker_app = EngineWorker.options(**options)  # type: ignore[attr-defined]
    return worker_app.bind(worker_cfg, cfg.router.served_model_name)


def _bundles(group: RoleGroup, size: int) -> list[dict[str, float]]:
    """One bundle per rank; rank 0 is the replica itself."""
    bundle = {"CPU": max(group.num_cpus, 0.01), **group.resources}
    if group.num_gpus:
        bundle["GPU"] = group.num_gpus
    return [dict(bundle) for _ in range(size)]


def build_app(args: dict[str, Any] | ServingConfig) -> Any:
    """Serve app builder: validate ``args`` as a ServingConfig and bind the deployments."""
    cfg = args if isinstance(args, ServingConfig) else ServingConfig.parse(dict(args))
    return bind_app(cfg)


def serve_admission_options(router: RouterSettings) -> dict[str, Any]:
    """The router deployment's Serve options that make the proxy enforce the admission
    budget (``router.api.admission``): at most ``max_in_flight`` requests per router
    replica, ``max_queued_requests`` held while every one is full, the rest refused at
    once with 429 and ``Retry-After``. With the proxy's door counting
    (``router.api.proxy_admission``), Serve's queue limit is only its backstop
    (``serve_queue_limit``)."""
    return {
        "max_ongoing_requests": router_max_ongoing(router.max_in_flight),
        "max_queued_requests": serve_queue_limit(router, limit_from_env() is not None),
        "backpressure_config": BackpressureConfig(
            status_code=429, retry_after_s=REFUSAL_RETRY_AFTER_S
        ),
    }


def bind_app(cfg: ServingConfig, router_options: Mapping[str, Any] | None = None) -> Any:
    """The app of ``cfg`` with ``cfg.router.num_replicas`` routers; ``router_options`` are
    Serve deployment options of the router, as a deploy file's ``deployments: [{name:
    router, ...}]`` entry would set them (e.g. ``{"ray_actor_options": {"runtime_env":
    {"env_vars": {...}}}}``)."""
    workers = {
        role: [_worker_app(cfg, role, i) for i in range(worker_count(cfg, role))]
        for role in cfg.roles()
    }
    options = (
        {
            "num_replicas": cfg.router.num_replicas,
            "graceful_shutdown_timeout_s": cfg.router.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        }
        | serve_admission_options(cfg.router)
        | dict(router_options or {})
    )
    # mypy keeps a decorated class's own type: Router is a Serve Deployment
    return Router.options(**options).bind(cfg.model_dump_json(), workers)  # type: ignore[attr-defined]
