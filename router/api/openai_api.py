"""The OpenAI-compatible HTTP layer: validate, admit, tokenize, stream from a backend.

``OpenAIServer`` holds all the logic in methods that take a starlette ``Request`` and
return a ``Response``, so a FastAPI app (``build_fastapi_app``) and a Ray Serve ingress
can both mount them. No torch and no Ray are imported here.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsv3serve.json_types import JSONObject
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.admission import Admission, Slot
from router.api.body import BodyLimits, read_json_object
from router.api.chat_output import OutputParsing
from router.api.chat_request import ReasoningParserName, plan_chat
from router.api.completion_batch import batch_prompts, run_batch, split_batch
from router.api.errors import (
    INTERNAL_ERROR,
    APIError,
    bad_request,
    error_body,
    error_response,
    from_backend_error,
    from_validation_error,
    internal_error,
)
from router.api.openai_fields import refused_field
from router.api.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.api.openai_response import ResponseBuilder, ResponseMeta
from router.api.openai_utility import ModelFacts, UtilityAPI
from router.api.request_params import (
    build_sampling_params,
    check_token_ids,
    completion_prompt_ids,
)
from router.api.sse import SSEResponse, StreamGuard, close_quietly, stream_events
from router.drain import Drain
from workers.backend import BackendError, GenerationBackend, error_from_chunk
from workers.protocol import GenerateRequest, TokenChunk

logger = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"


class APIConfig(BaseModel):
    """Settings of the OpenAI front end."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    served_model_name: str = "deepseek-v3-tiny"
    max_model_len: int = Field(ge=2, description="prompt + completion tokens per sequence")
    max_in_flight: int = Field(256, ge=1, description="admitted requests; more get 429")
    max_body_bytes: int = Field(1 << 20, ge=1)
    body_read_timeout_s: float = Field(30.0, gt=0, description="a slower body gets 408")
    max_json_depth: int = Field(128, ge=2, description="deeper nesting gets 400")
    vocab_size: int | None = Field(
        None, ge=1, description="token ids must be below it; None: the tokenizer's size"
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429")
    max_n: int = Field(16, ge=1)
    reasoning_parser: ReasoningParserName | None = Field(
        None, description="split <think> reasoning into reasoning_content (SGLang's names)"
    )
    special_tokens_in_content: bool = Field(
        False,
        description="special-token strings in chat messages become the tokens (vLLM's and "
        "SGLang's behaviour); False: they stay text, as with OpenAI",
    )


# ---- running a request -----------------------------------------------------------------
@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for admission."""

    request: GenerateRequest
    meta: ResponseMeta
    stream: bool
    include_usage: bool


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run ``work``; cancel it if the client disconnects first (its cleanup then aborts).

    Must start after the body has been read: the watcher consumes ASGI receive messages.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


async def first_chunk(chunks: AsyncGenerator[TokenChunk, None]) -> TokenChunk:
    """The backend's first chunk; its refusal or failure becomes an APIError."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        raise APIError(500, "the backend finished without any output", INTERNAL_ERROR) from None
    except BackendError as exc:
        raise from_backend_error(exc) from None
    if first.error is not None:
        raise from_backend_error(error_from_chunk(first))
    return first


async def collect(
    builder: ResponseBuilder, first: TokenChunk, chunks: AsyncGenerator[TokenChunk, None]
) -> JSONObject:
    """Wait for all ``n`` sequences; the whole non-streaming response body."""
    chunk: TokenChunk | None = first
    while chunk is not None:
        if chunk.error is not None:
            raise from_backend_error(error_from_chunk(chunk))
        builder.add(chunk)
        chunk = await anext(chunks, None)
    return builder.response()


class OpenAIServer:
    """OpenAI-compatible endpoints over a GenerationBackend.

    Each endpoint method takes a starlette ``Request`` and returns a ``Response``; every
    failure is answered with an OpenAI error body, never an exception.
    """

    def __init__(self, config: APIConfig, tokenizer: Tokenizer, backend: GenerationBackend) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.backend = backend
        self.admission = Admission(config.max_in_flight)
        self.drain = Drain()
        self.created = int(time.time())
        self.vocab_size = config.vocab_size or tokenizer.vocab_size
        self.body_limits = BodyLimits(
            config.max_body_bytes, config.body_read_timeout_s, config.max_json_depth
        )
        self.facts = ModelFacts(
            config.served_model_name,
            config.max_model_len,
            self.vocab_size,
            self.created,
            config.special_tokens_in_content,
        )
        self.utility = UtilityAPI(self.facts, tokenizer, self.body_limits)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._handle(request, "chat")

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._handle(request, "completion")

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the one served model."""
        return JSONResponse({"object": "list", "data": [self.facts.card()]})

    async def health(self, request: Request) -> Response:
        """GET /health: 200 when the backend is healthy, else 503."""
        try:
            healthy = await self.backend.is_healthy()
        except Exception:
            logger.exception("backend health check failed")
            healthy = False
        status = "ok" if healthy else "unhealthy"
        return JSONResponse({"status": status}, status_code=200 if healthy else 503)

    async def _handle(self, request: Request, kind: Kind) -> Response:
        try:
            self.check_capacity()  # before the body read and tokenization
            body = await read_json_object(request, self.body_limits)
            prompts = (
                batch_prompts(body, self.config.max_in_flight) if kind == "completion" else None
            )
            if prompts is not None:
                batch = [self.prepare(one, kind) for one in split_batch(body, prompts)]
                return await run_until_disconnect(request, self._run_batch(batch))
            prepared = self.prepare(body, kind)
            return await run_until_disconnect(request, self._run(prepared))
        except APIError as err:
            return self._error(err)
        except BackendError as exc:
            return self._error(from_backend_error(exc))
        except Exception as exc:
            logger.exception("%s request failed", kind)
            return self._error(internal_error(exc))

    def prepare(self, body: JSONObject, kind: Kind) -> Prepared:
        """Validate ``body`` into a GenerateRequest with a router-assigned id: the one
        validation path of HTTP and gRPC. Raises APIError (400; 404 for the model)."""
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        problem = refused_field(body, kind) or req.unsupported()
        if problem is not None:
            raise bad_request(problem[1], problem[0])
        self.facts.check_model(req.model)
        plan = None
        if isinstance(req, ChatCompletionRequest):
            plan = plan_chat(
                self.tokenizer,
                req,
                self.config.reasoning_parser,
                self.config.special_tokens_in_content,
            )
            ids, prompt_param, extra = plan.prompt_ids, "messages", plan.sampling_extra
        else:
            ids = completion_prompt_ids(self.tokenizer, req, self.vocab_size)
            prompt_param, extra = "prompt", {}
        check_token_ids(req.stop_token_ids or [], self.vocab_size, "stop_token_ids")
        check_token_ids(list(req.logit_bias or {}), self.vocab_size, "logit_bias")
        params = build_sampling_params(req, len(ids), self.config, prompt_param, extra)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        gen = GenerateRequest(request_id=request_id, prompt_ids=ids, params=params)
        echo = self._echo_text(req, ids)
        parsing = None if plan is None else plan.parsing(self.tokenizer, params)
        return Prepared(gen, self._meta(kind, gen, parsing, echo), req.stream, req.include_usage)

    def _echo_text(self, req: SamplingFields, ids: list[int]) -> str:
        """Completions ``echo``: the prompt as given, or its token ids decoded."""
        if not isinstance(req, CompletionRequest) or not req.echo:
            return ""
        prompt = req.single_prompt()
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, False)

    def _meta(
        self, kind: Kind, gen: GenerateRequest, parsing: OutputParsing | None, echo: str = ""
    ) -> ResponseMeta:
        return ResponseMeta(
            kind=kind,
            request_id=gen.request_id,
            model=self.config.served_model_name,
            created=int(time.time()),
            n=gen.params.n,
            prompt_tokens=len(gen.prompt_ids),
            want_logprobs=gen.params.logprobs is not None,
            token_text=self._token_text,
            echo=echo,
            parsing=parsing,
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_capacity(self) -> None:
        """Raise the 429 at once when ``max_in_flight`` requests are in flight, so a full
        router refuses before it spends time on the body (``_admit`` still takes the slot)."""
        if self.admission.full:
            raise self._capacity_error()

    def _capacity_error(self) -> APIError:
        limit = self.admission.max_in_flight
        message = f"the server is at capacity ({limit} requests in flight); retry later"
        return APIError(429, message, "rate_limit_exceeded", code="rate_limit_exceeded")

    def _admit(self) -> Slot:
        if self.drain.draining:
            message = "the server is shutting down; retry on another server or later"
            retry = {"Retry-After": str(self.config.retry_after_s)}
            raise APIError(503, message, "service_unavailable", headers=retry)
        slot = self.admission.try_acquire()
        if slot is None:
            raise self._capacity_error()
        return slot

    def _error(self, err: APIError) -> Response:
        """``err`` as a response; every 429 (ours or the backend's) carries Retry-After."""
        if err.status == 429 and err.headers is None:
            err.headers = {"Retry-After": str(self.config.retry_after_s)}
        return error_response(err)

    async def _start(
        self, slot: Slot, req: GenerateRequest
    ) -> tuple[AsyncGenerator[TokenChunk, None], TokenChunk]:
        """The backend stream and its first chunk; on any failure the slot is released."""
        chunks: AsyncGenerator[TokenChunk, None] | None = None
        try:
            chunks = self.drain.watch(self.backend.generate(req))
            return chunks, await first_chunk(chunks)
        except BaseException:
            slot.release()
            if chunks is not None:
                await close_quietly(chunks)
            raise

    async def open(self, prepared: Prepared) -> tuple[StreamGuard, TokenChunk]:
        """Admit ``prepared`` and start it on the backend: its guard and first chunk.

        Raises APIError: 429 over ``max_in_flight``, or the backend's refusal. The caller
        must ``close`` the guard (it frees the slot and aborts the request if unfinished).
        """
        slot = self._admit()
        chunks, first = await self._start(slot, prepared.request)
        return StreamGuard(slot, chunks), first

    async def _run(self, prepared: Prepared) -> Response:
        if not prepared.stream:
            return JSONResponse(await self._whole(prepared))
        guard, first = await self.open(prepared)
        builder = ResponseBuilder(prepared.meta)
        return SSEResponse(stream_events(builder, first, guard, prepared.include_usage), guard)

    async def _whole(self, prepared: Prepared) -> JSONObject:
        """The whole (non-streaming) response body of ``prepared``."""
        guard, first = await self.open(prepared)
        try:
            return await collect(ResponseBuilder(prepared.meta), first, guard.chunks)
        finally:
            await guard.close()

    async def _run_batch(self, batch: list[Prepared]) -> Response:
        """A list of completions prompts, one response (``router/api/completion_batch.py``)."""
        return JSONResponse(await run_batch(batch, self._whole))


def new_app() -> FastAPI:
    """An empty FastAPI app for the OpenAI routes: no docs pages, no redirects (a
    trailing slash is a 404 with an error body, not a 307), routing errors as OpenAI
    error bodies."""
    app = FastAPI(title="dsv3serve", docs_url=None, redoc_url=None, redirect_slashes=False)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail)
    if exc.status_code in (404, 405):
        message = f"{message}: {request.method} {request.url.path}"
    return JSONResponse(error_body(message, "invalid_request_error"), exc.status_code, exc.headers)


def build_fastapi_app(server: OpenAIServer) -> FastAPI:
    """A FastAPI app with the OpenAI routes mounted on ``server``'s methods."""
    app = new_app()
    routes = [
        ("/v1/chat/completions", server.chat_completions, ["POST"]),
        ("/v1/completions", server.completions, ["POST"]),
        ("/v1/models", server.models, ["GET"]),
        ("/v1/models/{model:path}", server.utility.model, ["GET"]),
        ("/health", server.health, ["GET", "HEAD"]),
        ("/version", server.utility.version, ["GET"]),
        ("/tokenize", server.utility.tokenize, ["POST"]),
        ("/detokenize", server.utility.detokenize, ["POST"]),
    ]
    for path, endpoint, methods in routes:
        app.add_api_route(path, endpoint, methods=methods, response_model=None)
    return app
