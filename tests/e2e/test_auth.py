"""Optional API-key auth: HTTP 401 and gRPC UNAUTHENTICATED without the right key.

The served app is the colocated one (auth sits in the router, whatever the backend); the
key reaches the router replica alone, through its Ray ``runtime_env``, so neither this
process's environment nor any other test sees it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
from serving_util import ServeCluster, running_app, serving_config

from dsv3serve.settings import API_KEY_ENV
from router.api.auth import MISSING_KEY, WRONG_KEY, APIKeyAuth
from router.config import ConfigError
from router.proto import generate_pb2 as pb
from router.proto.generate_pb2_grpc import GenerationStub

APP = "keyed"
KEY = "sk-test-0123456789abcdef"
GOOD = f"Bearer {KEY}"
BAD_AUTHORIZATIONS = [None, "", f"Bearer {KEY}x", KEY, f"Basic {KEY}", "Bearer"]
REQUEST = pb.GenerateRequest(text="Hello", sampling=pb.SamplingOptions(max_tokens=2))


@dataclass(frozen=True)
class Served:
    url: str
    stub: GenerationStub


@pytest.fixture(scope="module")
def served(serve_cluster: ServeCluster) -> Iterator[Served]:
    grpc_port = serve_cluster.grpc_port
    env = {"runtime_env": {"env_vars": {API_KEY_ENV: KEY}}}
    with (
        running_app(
            serve_cluster.base, APP, serving_config(mode="colocated"), {"ray_actor_options": env}
        ) as url,
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        yield Served(url, GenerationStub(channel))


def headers(authorization: str | None) -> dict[str, str]:
    return {} if authorization is None else {"Authorization": authorization}


def metadata(authorization: str | None) -> list[tuple[str, str]]:
    auth = [] if authorization is None else [("authorization", authorization)]
    return [("application", APP), *auth]


# ---- HTTP ------------------------------------------------------------------------------
def test_health_version_and_metrics_need_no_key(served: Served) -> None:
    for route in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{served.url}{route}", timeout=60).status_code == 200, route
    assert httpx.head(f"{served.url}/health", timeout=30).status_code == 200


GETS = ("/v1/models", "/v1/models/tiny")
KEYED = [*GETS, "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
@pytest.mark.parametrize("route", KEYED)
def test_http_without_the_key_is_401(served: Served, route: str, authorization: str) -> None:
    body = {"model": "tiny", "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}
    body |= {"tokens": [1]}
    method = "GET" if route in GETS else "POST"
    response = httpx.request(
        method, served.url + route, json=body, headers=headers(authorization), timeout=30
    )
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert KEY not in response.text


def test_openai_client_with_the_key_succeeds(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["tiny"]
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert reply.usage.completion_tokens == 3


def test_openai_client_with_a_wrong_key_is_refused(served: Served) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert info.value.code == "invalid_api_key"


# ---- gRPC ------------------------------------------------------------------------------
@pytest.mark.parametrize("authorization", BAD_AUTHORIZATIONS)
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_grpc_without_the_key_is_unauthenticated(
    served: Served, rpc: str, authorization: str | None
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        reply = getattr(served.stub, rpc)(REQUEST, metadata=metadata(authorization), timeout=30)
        if rpc.endswith("Stream"):
            list(reply)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert KEY not in info.value.details()


def test_grpc_chat_without_the_key_is_unauthenticated(served: Served) -> None:
    chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")])
    with pytest.raises(grpc.RpcError) as info:
        served.stub.ChatComplete(chat, metadata=metadata(None), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_with_the_key_succeeds_and_health_is_open(served: Served) -> None:
    reply = served.stub.Generate(REQUEST, metadata=metadata(GOOD), timeout=60)
    assert reply.usage.completion_tokens == 2
    stream = served.stub.GenerateStream(REQUEST, metadata=metadata(GOOD), timeout=60)
    assert list(stream)[-1].usage.completion_tokens == 2
    health = served.stub.Health(pb.HealthRequest(), metadata=metadata(None), timeout=30)
    assert health.status == "ok"


# ---- the key itself --------------------------------------------------------------------
def test_no_key_means_open() -> None:
    auth = APIKeyAuth.from_env(None, {})
    assert not auth.enabled and auth.refusal(None) is None


def test_key_from_the_default_variable_or_a_named_one() -> None:
    default = APIKeyAuth.from_env(None, {API_KEY_ENV: f" {KEY}\n"})  # a Secret's newline
    named = APIKeyAuth.from_env("MY_KEY", {"MY_KEY": KEY, API_KEY_ENV: "other"})
    for auth in (default, named):
        assert auth.refusal(GOOD) is None and auth.refusal(f"bearer  {KEY} ") is None
        assert auth.refusal(None) == auth.refusal("Bearer") == MISSING_KEY
        assert auth.refusal("Bearer other") == WRONG_KEY
        assert KEY not in repr(auth)


@pytest.mark.parametrize("environ", [{}, {"MY_KEY": ""}, {"MY_KEY": "  "}])
def test_a_named_variable_must_hold_a_key(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="router.api_key_env: .*MY_KEY"):
        APIKeyAuth.from_env("MY_KEY", environ)
