"""The endpoints around generation that clients coming from vLLM and OpenAI call.

``GET /v1/models/{model}`` (the ``openai`` client's ``models.retrieve``), ``GET
/version``, and vLLM's ``POST /tokenize`` / ``POST /detokenize`` with vLLM's request and
response shapes: a ``prompt`` or a chat ``messages`` list (rendered and tokenised exactly
as ``/v1/chat/completions`` does) in, ``{"count", "max_model_len", "tokens",
"token_strs"}`` out; token ids in, ``{"prompt"}`` out. Fields vLLM takes that would
change the answer and are not honoured here (another chat template, continuing the final
message) are refused with a 400.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsv3serve.json_types import JSONObject
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.body import BodyLimits, read_json_object
from router.api.errors import APIError, bad_request, error_response, from_validation_error
from router.api.openai_protocol import ChatCompletionRequest
from router.api.request_part import RequestPart

PACKAGE = "dsv3serve"
Part = TypeVar("Part", bound=RequestPart)


class TokenizePrompt(RequestPart):
    """vLLM's ``/tokenize`` body for a plain prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS first, as /v1/completions tokenises a prompt
    return_token_strs: bool = False


class TokenizeChat(ChatCompletionRequest):
    """vLLM's ``/tokenize`` body for a conversation (tools and template kwargs included)."""

    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template already starts with BOS
    return_token_strs: bool = False
    continue_final_message: Literal[False] = False
    chat_template: None = None


class Detokenize(RequestPart):
    """vLLM's ``/detokenize`` body."""

    model: str | None = None
    tokens: list[int]


@dataclass(frozen=True)
class ModelFacts:
    """What the utility endpoints report about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    created: int
    special_tokens_in_content: bool = False

    def card(self) -> JSONObject:
        """The model object of ``/v1/models``."""
        card: JSONObject = {"id": self.name, "object": "model", "created": self.created}
        return card | {"owned_by": PACKAGE, "root": self.name, "max_model_len": self.max_model_len}

    def check_model(self, model: str | None) -> None:
        """404 (OpenAI's ``model_not_found``) for a model this server does not serve."""
        if model is not None and model != self.name:
            raise not_found(model)


def not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found"
    )


def package_version() -> str:
    """The installed dsv3serve version ("unknown" when run from a bare source tree)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class UtilityAPI:
    """``/v1/models/{model}``, ``/version``, ``/tokenize``, ``/detokenize``; every failure
    is an OpenAI error body."""

    def __init__(self, facts: ModelFacts, tokenizer: Tokenizer, limits: BodyLimits) -> None:
        self.facts, self.tokenizer, self.limits = facts, tokenizer, limits

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the model's card, or 404."""
        model = request.path_params.get("model", "")
        if model != self.facts.name:
            return error_response(not_found(model))
        return JSONResponse(self.facts.card())

    async def version(self, request: Request) -> Response:
        """GET /version: ``{"version": ...}`` as vLLM answers it."""
        return JSONResponse({"version": package_version()})

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize."""
        try:
            body = await read_json_object(request, self.limits)
            ids, want_strs = self._tokenize(body)
        except APIError as err:
            return error_response(err)
        strs = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        answer = {"count": len(ids), "max_model_len": self.facts.max_model_len, "tokens": ids}
        return JSONResponse(answer | {"token_strs": strs if want_strs else None})

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize."""
        try:
            body = _validate(Detokenize, await read_json_object(request, self.limits))
            self.facts.check_model(body.model)
            bad = next((t for t in body.tokens if not 0 <= t < self.facts.vocab_size), None)
            if bad is not None:
                raise bad_request(
                    f"tokens: ids must be in [0, {self.facts.vocab_size}), got {bad}", "tokens"
                )
        except APIError as err:
            return error_response(err)
        return JSONResponse({"prompt": self.tokenizer.decode(body.tokens, False)})

    def _tokenize(self, body: JSONObject) -> tuple[list[int], bool]:
        if "messages" in body:
            chat = _validate(TokenizeChat, body)
            self.facts.check_model(chat.model)
            return self._chat_ids(chat), chat.return_token_strs
        plain = _validate(TokenizePrompt, body)
        self.facts.check_model(plain.model)
        return self.tokenizer.encode(
            plain.prompt, plain.add_special_tokens
        ), plain.return_token_strs

    def _chat_ids(self, chat: TokenizeChat) -> list[int]:
        messages = chat.template_messages(self.tokenizer.chat_flavor == "deepseek-r1")
        try:
            pieces = self.tokenizer.chat_pieces(
                messages, chat.add_generation_prompt, thinking=chat.thinking
            )
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        ids = self.tokenizer.encode_prompt(pieces, self.facts.special_tokens_in_content)
        if chat.add_special_tokens and ids[:1] != [self.tokenizer.bos_token_id]:
            ids.insert(0, self.tokenizer.bos_token_id)
        return ids


def _validate(model: type[Part], body: JSONObject) -> Part:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
