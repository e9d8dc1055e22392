"""Protobuf <-> the HTTP layer's shapes, for the gRPC front end (``router/proto``).

Requests become the same JSON-like bodies an HTTP client would send, so one validation
path (``OpenAIServer.prepare``) serves both front ends; responses are built from the
HTTP layer's ``ResponseBuilder`` state and backend ``TokenChunk``s.
"""

from __future__ import annotations

import json
from typing import Literal, TypedDict

from dsv3serve.json_types import JSONObject, JSONValue, json_int, json_list, json_object, json_str
from router.api.chat_output import ChatDelta, ChoiceParser
from router.api.errors import bad_request
from router.api.openai_protocol import TopLogprobs
from router.api.openai_response import ChoiceState, ResponseBuilder, ResponseMeta
from router.proto import generate_pb2 as pb
from workers.protocol import TokenChunk

Kind = Literal["chat", "completion"]


# ---- requests -> bodies ----------------------------------------------------------------
def sampling_body(options: pb.SamplingOptions, kind: Kind) -> JSONObject:
    """The request fields the client set; an unset one takes the HTTP default."""
    body = {
        field.name: list(value) if field.is_repeated else value
        for field, value in options.ListFields()
        if field.name not in STRUCTURE_FIELDS and field.name != "logit_bias"
    }
    top = body.pop("logprobs", None)
    if top is not None:  # chat asks with a flag plus a count, completions with the count
        body |= {"logprobs": True, "top_logprobs": top} if kind == "chat" else {"logprobs": top}
    if options.logit_bias:  # HTTP's JSON object keys are strings
        body["logit_bias"] = {str(token): bias for token, bias in options.logit_bias.items()}
    return body | structure_fields(options)


STRUCTURE_FIELDS = ("json_object", "json_schema", "regex", "ebnf", "json_schema_strict")


def structure_fields(options: pb.SamplingOptions) -> JSONObject:
    """The HTTP fields of the options' structured-output choice (``response_format``,
    ``regex`` or ``ebnf``); a ``json_schema`` that is not JSON is INVALID_ARGUMENT."""
    which = options.WhichOneof("structure")
    if which == "json_object":
        return {"response_format": {"type": "json_object"}} if options.json_object else {}
    if which == "json_schema":
        try:
            schema = json.loads(options.json_schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"json_schema is not valid JSON: {exc}", "json_schema") from None
        spec = {"name": "grpc", "schema": schema, "strict": options.json_schema_strict}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    if which in ("regex", "ebnf"):
        return {which: getattr(options, which)}
    return {}


def completion_body(request: pb.GenerateRequest) -> JSONObject:
    """A ``/v1/completions`` body: the text or token-id prompt and the sampling options."""
    body = sampling_body(request.sampling, "completion")
    prompt = request.WhichOneof("prompt")
    if prompt == "text":
        body["prompt"] = request.text
    elif prompt == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    if request.model:
        body["model"] = request.model
    return body


def _message(message: pb.ChatMessage) -> JSONObject:
    body: JSONObject = {"role": message.role, "content": message.content}
    if message.tool_calls:
        body["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
        body["content"] = message.content or None
    if message.tool_call_id:
        body["tool_call_id"] = message.tool_call_id
    return body


def _tool(index: int, tool: pb.FunctionTool) -> JSONObject:
    function: JSONObject = {"name": tool.name, "strict": tool.strict}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        try:
            function["parameters"] = json.loads(tool.parameters_json)
        except json.JSONDecodeError as exc:
            param = f"tools[{index}].parameters_json"
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    return {"type": "function", "function": function}


def _tool_fields(request: pb.ChatRequest) -> JSONObject:
    """``tools``, ``tool_choice`` and the reasoning switches the client set."""
    body: JSONObject = {}
    if request.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(request.tools)]
    choice = request.tool_choice.WhichOneof("choice")
    if choice == "mode":
        body["tool_choice"] = request.tool_choice.mode
    elif choice == "function":
        name = request.tool_choice.function
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    for name in ("parallel_tool_calls", "separate_reasoning", "include_reasoning"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    return body


def chat_body(request: pb.ChatRequest) -> JSONObject:
    """A ``/v1/chat/completions`` body; raises APIError (400) for unreadable tool JSON."""
    body = sampling_body(request.sampling, "chat")
    body["messages"] = [_message(m) for m in request.messages]
    if request.HasField("thinking"):
        body["chat_template_kwargs"] = {"thinking": request.thinking}
    if request.model:
        body["model"] = request.model
    return body | _tool_fields(request)


# ---- chunks and builder state -> responses ---------------------------------------------
def token_logprobs(
    ids: list[int], logprobs: list[float], tops: TopLogprobs, meta: ResponseMeta
) -> list[pb.TokenLogprob]:
    """Per token: its id, text and logprob, and the requested top alternatives."""
    text = meta.token_text
    entries = []
    for i, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=False)):
        top = tops[i] if i < len(tops) else []
        alternatives = [pb.TopLogprob(token_id=t, token=text(t), logprob=lp) for t, lp in top]
        entries.append(
            pb.TokenLogprob(
                token_id=token_id, token=text(token_id), logprob=logprob, top_logprobs=alternatives
            )
        )
    return entries


def usage_message(usage: JSONObject) -> pb.Usage:
    """``ResponseBuilder.usage()`` as a message."""
    cached = json_object(usage["prompt_tokens_details"], "prompt_tokens_details")
    message = pb.Usage(
        prompt_tokens=json_int(usage["prompt_tokens"], "prompt_tokens"),
        completion_tokens=json_int(usage["completion_tokens"], "completion_tokens"),
        total_tokens=json_int(usage["total_tokens"], "total_tokens"),
        cached_tokens=json_int(cached["cached_tokens"], "cached_tokens"),
    )
    details = usage.get("completion_tokens_details")
    if details is not None:
        reasoning = json_object(details, "completion_tokens_details")["reasoning_tokens"]
        message.reasoning_tokens = json_int(reasoning, "reasoning_tokens")
    return message


def _call(entry: JSONObject, i: int) -> pb.ToolCall:
    function = json_object(entry["function"], "tool call function")
    return pb.ToolCall(
        index=json_int(entry.get("index", i), "tool call index"),
        id=json_str(entry.get("id", ""), "tool call id"),
        name=json_str(function.get("name", ""), "tool call name"),
        arguments=json_str(function.get("arguments", ""), "tool call arguments"),
    )


def _calls(entries: list[JSONValue]) -> list[pb.ToolCall]:
    """OpenAI ``tool_calls`` entries (whole or delta) as messages."""
    return [_call(json_object(entry, "tool call"), i) for i, entry in enumerate(entries)]


class ChoiceFields(TypedDict, total=False):
    """The text fields of a ``pb.Choice``, as :func:`_whole_text` and :func:`_delta_fields`
    fill them (checked against the message's constructor)."""

    text: str
    reasoning_content: str
    tool_calls: list[pb.ToolCall]
    finish_reason: str


def _parsed_fields(body: JSONObject, finish_reason: str) -> ChoiceFields:
    """A parsed chat message or delta as Choice fields (text is the content)."""
    return {
        "text": json_str(body.get("content") or "", "content"),
        "reasoning_content": json_str(body.get("reasoning_content") or "", "reasoning_content"),
        "tool_calls": _calls(json_list(body.get("tool_calls") or [], "tool_calls")),
        "finish_reason": finish_reason,
    }


def _whole_text(state: ChoiceState) -> ChoiceFields:
    text = "".join(state.text)
    if state.parser is None:
        return {"text": text, "finish_reason": state.finish_reason or ""}
    state.parser.parse_whole(text)
    reason = state.parser.finish_reason(state.finish_reason) or ""
    return _parsed_fields(state.parser.message(), reason)


def _whole_choice(index: int, state: ChoiceState, meta: ResponseMeta) -> pb.Choice:
    choice = pb.Choice(index=index, token_ids=state.token_ids, **_whole_text(state))
    if meta.want_logprobs:
        choice.logprobs.extend(
            token_logprobs(state.token_ids, state.logprobs, state.top_logprobs, meta)
        )
    return choice


def whole_response(builder: ResponseBuilder) -> pb.GenerateResponse:
    """Generate / ChatComplete: every sequence whole, and the usage."""
    meta = builder.meta
    return pb.GenerateResponse(
        request_id=meta.request_id,
        model=meta.model,
        created=meta.created,
        choices=[_whole_choice(i, s, meta) for i, s in enumerate(builder.choices)],
        usage=usage_message(builder.usage()),
    )


def _delta_fields(chunk: TokenChunk, parser: ChoiceParser | None) -> ChoiceFields:
    """Text fields and finish reason of ``chunk``, split by ``parser`` when there is one."""
    reason = (chunk.finish_reason or "") if chunk.finished else ""
    if parser is None:
        return {"text": chunk.text, "finish_reason": reason}
    delta: ChatDelta = parser.step(chunk.text, chunk.finished)
    if chunk.finished:
        reason = parser.finish_reason(chunk.finish_reason) or ""
    return _parsed_fields(parser.delta_body(delta), reason)


def stream_message(
    chunk: TokenChunk, meta: ResponseMeta, parser: ChoiceParser | None = None
) -> pb.GenerateStreamResponse | None:
    """The new output of ``chunk``'s sequence (split by the choice's ``parser``, which it
    advances); None when the chunk carries nothing."""
    if not (chunk.text or chunk.token_ids or chunk.finished):
        return None
    choice = pb.Choice(index=chunk.index, token_ids=chunk.token_ids, **_delta_fields(chunk, parser))
    if meta.want_logprobs:
        choice.logprobs.extend(
            token_logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs, meta)
        )
    return pb.GenerateStreamResponse(request_id=meta.request_id, choice=choice)


def usage_stream_message(builder: ResponseBuilder) -> pb.GenerateStreamResponse:
    """The last message of a stream: the usage of all sequences."""
    return pb.GenerateStreamResponse(
        request_id=builder.meta.request_id, usage=usage_message(builder.usage())
    )
