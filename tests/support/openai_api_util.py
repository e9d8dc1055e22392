"""One engine behind a real OpenAI-compatible HTTP server, for the OpenAI API tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from engine_util import make_engine
from http_util import ServerThread

from dsv3serve.engine.engine import Engine
from router.api.openai_api import APIConfig, OpenAIServer, build_fastapi_app
from workers.local import LocalEngineBackend

MAX_MODEL_LEN = 1024
MODEL = "deepseek-v3-tiny"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three prime numbers."},
]
GREEDY_CHAT = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@dataclass
class Served:
    """One engine behind one real HTTP server."""

    engine: Engine
    backend: Any
    server: OpenAIServer
    http: ServerThread

    @property
    def url(self) -> str:
        return self.http.url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)


def serve(backend_of: Callable[[LocalEngineBackend], Any], **config: Any) -> Iterator[Served]:
    engine = make_engine(max_model_len=MAX_MODEL_LEN)
    backend = backend_of(LocalEngineBackend(engine))
    vocab = engine.model_cfg.vocab_size  # the model's, as the router gets it from a worker
    api = APIConfig(max_model_len=MAX_MODEL_LEN, vocab_size=vocab, **config)
    server = OpenAIServer(api, engine.tokenizer, backend)
    with ServerThread(build_fastapi_app(server)) as http:
        yield Served(engine, backend, server, http)


@pytest.fixture(scope="module", name="served")
def served_fixture() -> Iterator[Served]:
    yield from serve(lambda b: b)


@pytest.fixture(scope="module", name="client")
def client_fixture(served: Served) -> openai.OpenAI:
    return served.client()


def wait_idle(served: Served, timeout_s: float = 5.0) -> None:
    """Until no sequence is live, no slot is held and every KV page is free."""
    engine, kv = served.engine, served.engine.scheduler.kv
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with served.backend.engine._lock:  # the AsyncEngine steps from another thread
            if not engine.has_unfinished() and served.server.admission.in_flight == 0:
                kv.evict_all()
                if kv.free_pages == kv.num_pages:
                    assert engine.scheduler.num_running + engine.scheduler.num_waiting == 0
                    return
        time.sleep(0.02)
    raise AssertionError(
        f"not idle after {timeout_s} s: unfinished={engine.has_unfinished()}, "
        f"in_flight={served.server.admission.in_flight}, free={kv.free_pages}/{kv.num_pages}"
    )


# ---- bad input ---------------------------------------------------------------------------
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
