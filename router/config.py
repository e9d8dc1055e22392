"""The serving app's configuration: one pydantic object, from a YAML file or app args."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dsv3serve.engine.config import EngineConfig
from dsv3serve.json_types import JSONObject, JSONValue, json_list, json_object
from router.routing.policy import Policy
from workers.config import WorkerConfig
from workers.pd_compat import check_pd_kv_compatible
from workers.protocol import Role


class ConfigError(ValueError):
    """An invalid serving config; the message names each bad field."""


class RoleGroup(BaseModel):
    """The replicas of one role and the resources of each."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_replicas: int = Field(1, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(
        {}, description="custom Ray resources per rank, e.g. {'decode_node': 1} to pin a node"
    )
    engine: dict[str, Any] = Field(
        {}, description="EngineConfig fields for this role only (tp_size: ranks per replica)"
    )

    min_replicas: int | None = Field(
        None, ge=1, description="autoscaling floor (with slo set); None: num_replicas"
    )
    max_replicas: int | None = Field(
        None, ge=1, description="autoscaling ceiling (with slo set); None: num_replicas"
    )

    def bounds(self) -> tuple[int, int]:
        """(min, max) replicas of this role; both num_replicas unless set."""
        low = self.num_replicas if self.min_replicas is None else self.min_replicas
        high = self.num_replicas if self.max_replicas is None else self.max_replicas
        return low, high

    @model_validator(mode="after")
    def _check_bounds(self) -> RoleGroup:
        low, high = self.bounds()
        if self.num_replicas and not low <= self.num_replicas <= high:
            raise ValueError(
                f"expected min_replicas ({low}) <= num_replicas ({self.num_replicas}) "
                f"<= max_replicas ({high})"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "group_size" in data:
            raise ValueError(
                "group_size was replaced by engine.tp_size (SGLang's name): set "
                "engine: {tp_size: N} on the role, with its layout fields"
            )
        return data


class SLO(BaseModel):
    """Latency targets the autoscaling policies size the roles for
    (router/autoscale/decisions.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_p99_s: float = Field(gt=0, description="time to first token, p99: drives prefill")
    itl_p99_s: float = Field(gt=0, description="inter-token latency, p99: drives decode")
    cooldown_s: float = Field(
        10.0, ge=0, description="a role's replica count changes at most once per cooldown"
    )
    metrics_interval_s: float = Field(
        2.0, gt=0, description="how often workers report their autoscaling metrics to Serve"
    )
    look_back_period_s: float = Field(
        10.0, gt=0, description="Serve's window over the reported metrics"
    )
    drain_timeout_s: float = Field(
        120.0,
        gt=0,
        description="a leaving worker replica is kept at most this long for its decode "
        "streams and prefills, then its stop waits this long again for what is left "
        "(Serve's graceful_shutdown_timeout_s)",
    )
    membership_period_s: float = Field(
        1.0,
        gt=0,
        description="how often the router reads which worker replicas run and which "
        "the policy marked leaving",
    )


class RouterSettings(BaseModel):
    """HTTP front end, admission and PD orchestration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    served_model_name: str = "deepseek-v3"
    max_in_flight: int = Field(
        256,
        ge=1,
        description="requests a router replica admits at once (its Serve "
        "max_ongoing_requests); beyond every router's, Serve's proxy queues, then answers 429",
    )
    max_queued_requests: int = Field(
        1024,
        ge=-1,
        description="requests Serve's proxy holds while every router replica is at "
        "max_in_flight (Serve's max_queued_requests, which counts a burst's requests as "
        "queued while it places them); more get 429 at once with Retry-After; -1: no limit",
    )

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_limit(cls, value: int) -> int:
        if value == 0:
            raise ValueError("expected -1 (no limit) or at least 1, as Serve takes it")
        return value

    graceful_shutdown_timeout_s: float = Field(
        30.0,
        gt=0,
        description="on SIGTERM or Ctrl-C, dsv3serve serve lets running requests finish "
        "for at most this long (new ones get 503), ends the rest with an error, then "
        "exits; also the router deployment's Serve graceful_shutdown_timeout_s",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024)
    body_read_timeout_s: float = Field(
        30.0, gt=0, description="a request body not received within it gets 408"
    )
    max_json_depth: int = Field(128, ge=8, description="deeper JSON nesting gets 400")
    policy: Policy = Field(
        "rank_aware",
        description="rank_aware: score (replica, DP rank) by the ranks' reported load and "
        "prefix caches (router/routing/rank_routing.py); prefix_affinity: a hash of the leading "
        "pages, then load; least_outstanding: this router's own load",
    )
    rank_report_interval_s: float = Field(
        0.5, gt=0, description="rank_aware: how often each replica's per-rank load is polled"
    )
    rank_tokens_per_request: float = Field(
        256.0, ge=0, description="rank_aware: a running or waiting request's price in tokens"
    )
    rank_tokens_per_pool: float = Field(
        1024.0, ge=0, description="rank_aware: a full KV pool's price in tokens"
    )
    rank_host_hit_value: float = Field(
        0.5,
        ge=0,
        le=1,
        description="rank_aware: a prompt token cached in a rank's host tier (hierarchical "
        "cache), in tokens cached in its GPU pool",
    )
    prefix_affinity_pages: int = Field(4, ge=1)
    affinity_imbalance_tokens: int = Field(32768, ge=0)
    prefill_timeout_s: float = Field(
        600.0,
        gt=0,
        description="ceiling of one prefill try, queue time included; below it a try is "
        "given up only when its replica stalls (prefill_stall_timeout_s)",
    )
    prefill_stall_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a prefill try is given up when its replica does not answer a progress "
        "check within this, or its engine neither finished nor ran a step over this long "
        "(router/pd/prefill_watch.py); a busy replica (a long prompt ahead) is not stalled",
    )
    max_prefill_attempts: int = Field(2, ge=1)
    prefill_retry_wait_s: float = Field(
        30.0,
        ge=0,
        description="with every prefill replica down (failed, not answering since), wait "
        "this long for one to come back (e.g. restarted by Serve), then 503",
    )
    reserve_wait_s: float = Field(
        5.0,
        ge=0,
        description="a request waiting for decode KV room gets a 429 once the decode side "
        "made no progress for this long (no engine step on a decode replica "
        "it asked, no request ended at this router): stuck, not busy; while it steps the "
        "request waits on (router/pd/room_signal.py)",
    )
    reserve_max_wait_s: float = Field(
        300.0,
        ge=0,
        description="the longest a request waits for decode KV room in all, however much "
        "room is being freed meanwhile; then 429",
    )
    max_decode_migrations: int = Field(
        1,
        ge=0,
        description="a stream whose decode replica fails is prefilled again (prompt + its "
        "tokens so far) and continued on a decode replica, at most this many times; 0: it "
        "ends with an in-band error (router/pd/migration.py)",
    )
    decode_migration_wait_s: float = Field(
        30.0,
        ge=0,
        description="with every decode replica down (e.g. the only one, while Serve "
        "restarts it), a migrating stream waits this long for one to come back",
    )
    num_replicas: int = Field(
        2,
        ge=1,
        description="router replicas (Serve deployment 'router'); with two, losing one "
        "leaves the other serving, and the streams it was serving end with an error event",
    )
    metrics_host: str = Field("127.0.0.1", description="internal metrics endpoint address")
    metrics_port: int | None = Field(
        8001,
        ge=0,
        le=65535,
        description="router replica k (its rank on its node) binds metrics_port + k; "
        "None: no endpoint",
    )
    reasoning_parser: Literal["deepseek-r1", "deepseek-v3"] | None = Field(
        None,
        description="split <think> reasoning into reasoning_content (SGLang's "
        "--reasoning-parser names); None: never split",
    )
    special_tokens_in_content: bool = Field(
        False,
        description="special-token strings typed into chat messages (BOS, EOS, role "
        "markers) become those tokens, as vLLM and SGLang tokenise them; False: they stay "
        "text, as with OpenAI, so a message cannot forge a turn",
    )
    api_key_env: str | None = Field(
        None,
        min_length=1,
        description="env var holding the API key (must be set); None: $DSV3SERVE_API_KEY, "
        "if set, else no authentication",
    )


class ServingConfig(BaseModel):
    """Everything ``build_app`` needs: the engine, the groups, transfer and routing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["pd", "colocated"] = "pd"
    engine: EngineConfig
    prefill: RoleGroup = RoleGroup()
    decode: RoleGroup = RoleGroup()
    colocated: RoleGroup = RoleGroup()
    kv_connector: Literal["shm", "torch_dist", "nixl", "mooncake"] = "shm"
    kv_connector_options: dict[str, Any] = {}
    kv_lease_s: float = Field(30.0, gt=0, description="staged KV is freed if not pulled")
    decode_prefix_reuse: bool = Field(
        True,
        description="decode replicas lock the prompt prefix their own cache holds and pull "
        "only the rest; False: every prompt page is pulled",
    )
    kv_transfer_overlap: bool = Field(
        True,
        description="a prefill stages the KV pages of its finished chunks while later "
        "chunks run and the decode replica pulls them at once, so the handoff after the "
        "prefill moves only the rest; False: every page moves after the prefill. Prefill "
        "replicas whose connector (nixl, mooncake) or speculative decoding rules it out "
        "stage once, after the prefill, either way",
    )
    torch_threads: int | None = Field(None, ge=1)
    group_timeout_s: float = Field(
        60.0, gt=0, description="a group collective waiting longer fails the engine's step"
    )
    router: RouterSettings = RouterSettings()
    slo: SLO | None = Field(
        None,
        description="latency targets; set: prefill and decode autoscale between their "
        "min_replicas and max_replicas under Serve's autoscaling (docs/autoscaling.md); "
        "None: fixed num_replicas",
    )
    test_prefill_delay_s: float = Field(0.0, ge=0, description="fault injection, tests only")
    test_receive_delay_s: float = Field(
        0.0, ge=0, description="fault injection, tests only: decode holds each KV pull this long"
    )
    test_reserve_delay_s: float = Field(
        0.0, ge=0, description="fault injection, tests only: decode holds each reserve this long"
    )
    test_fail_range_pulls: int = Field(
        0, ge=0, description="fault injection, tests only: decode fails its first N range pulls"
    )

    @model_validator(mode="after")
    def _check(self) -> ServingConfig:
        roles: tuple[Role, ...] = ("prefill", "decode") if self.mode == "pd" else ("colocated",)
        for role in roles:
            if getattr(self, role).num_replicas < 1:
                raise ValueError(f"{role}.num_replicas: mode {self.mode} needs at least 1")
        _refuse_unwired_autoscaling(self, roles)
        workers = {role: self._checked_worker_config(role) for role in roles}
        if self.mode == "pd":
            _check_same_speculation(workers["prefill"], workers["decode"])
            check_pd_kv_compatible(workers["prefill"], workers["decode"])
        return self

    def _checked_worker_config(self, role: Role) -> WorkerConfig:
        """``worker_config(role)``; its errors become one ValueError naming ``role``'s fields."""
        try:
            return self.worker_config(role)
        except ValidationError as exc:
            raise ValueError(_problems(role, exc)) from None

    @classmethod
    def parse(cls, data: JSONValue) -> ServingConfig:
        """Validate ``data``; raises ConfigError naming every bad field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = [
                f"{'.'.join(map(str, e['loc'])) or '<config>'}: {e['msg']}" for e in exc.errors()
            ]
            raise ConfigError("invalid serving config: " + "; ".join(problems)) from None

    def roles(self) -> tuple[Role, ...]:
        """The worker roles this mode runs."""
        return ("prefill", "decode") if self.mode == "pd" else ("colocated",)

    def worker_config(self, role: Role) -> WorkerConfig:
        """The WorkerConfig of ``role``'s replicas (shared engine + role overrides)."""
        group: RoleGroup = getattr(self, role)
        engine = EngineConfig.model_validate({**self.engine.model_dump(), **group.engine})
        return WorkerConfig(
            role=role,
            engine=engine,
            kv_connector=self.kv_connector,
            kv_connector_options=self.kv_connector_options,
            kv_lease_s=self.kv_lease_s,
            decode_prefix_reuse=self.decode_prefix_reuse,
            torch_threads=self.torch_threads,
            group_timeout_s=self.group_timeout_s,
            test_prefill_delay_s=self.test_prefill_delay_s if role == "prefill" else 0.0,
            test_receive_delay_s=self.test_receive_delay_s if role == "decode" else 0.0,
            test_reserve_delay_s=self.test_reserve_delay_s if role == "decode" else 0.0,
            test_fail_range_pulls=self.test_fail_range_pulls if role == "decode" else 0,
        )


def _refuse_unwired_autoscaling(cfg: ServingConfig, roles: tuple[Role, ...]) -> None:
    """Autoscaling runs in PD mode with ``slo`` set; varying bounds without ``slo`` (no
    targets to scale by) or ``slo`` in colocated mode are refused rather than ignored."""
    varying = [r for r in roles if len(set(getattr(cfg, r).bounds())) > 1]
    if cfg.slo is None and varying:
        raise ValueError(
            f"min_replicas < max_replicas on {varying}: expected slo set (the targets "
            "the replicas scale by) or min_replicas == max_replicas"
        )
    if cfg.slo is not None and cfg.mode != "pd":
        raise ValueError(
            f"slo: autoscaling runs prefill and decode; expected mode pd, found {cfg.mode}"
        )


def _check_same_speculation(prefill: WorkerConfig, decode: WorkerConfig) -> None:
    """Prefill and decode agree on speculative decoding: a speculative decode needs the
    draft layer's KV and draft state that only a speculative prefill produces."""
    p_algo = prefill.engine.speculative_algorithm
    d_algo = decode.engine.speculative_algorithm
    if (p_algo is None) != (d_algo is None):
        raise ValueError(
            f"prefill.engine.speculative_algorithm ({p_algo}) and "
            f"decode.engine.speculative_algorithm ({d_algo}): expected both set or both "
            "unset; the decode side's draft starts from the prefill side's draft state"
        )


def _problems(role: Role, exc: ValidationError) -> str:
    """``exc``'s errors, each prefixed with where it is in the serving config."""
    where = f"{role}.engine" if exc.title == "EngineConfig" else role
    problems = []
    for e in exc.errors():
        loc, msg = ".".join(map(str, e["loc"])), e["msg"].removeprefix("Value error, ")
        problems.append(f"{where}.{loc}: {msg}" if loc else f"{where}: {msg}")
    return "; ".join(problems)


def deploy_applications(data: JSONObject) -> list[JSONObject]:
    """The application entries of a Serve deploy config (its ``applications``)."""
    apps = json_list(data["applications"], "applications")
    return [json_object(app, f"applications[{i}]") for i, app in enumerate(apps)]


def app_args(app: JSONObject) -> JSONObject:
    """An application entry's ``args`` (empty where it has none)."""
    return json_object(app.get("args") or {}, "args")
