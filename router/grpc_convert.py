"""Protobuf <-> the HTTP layer's shapes, for the gRPC front end (``router/proto``).

Requests become the same JSON-like bodies an HTTP client would send, so one validation
path (``OpenAIServer.prepare``) serves both front ends; responses are built from the
HTTP layer's ``ResponseBuilder`` state and backend ``TokenChunk``s.
"""

from __future__ import annotations

from typing import Any, Literal

from router.openai_protocol import ChoiceState, ResponseBuilder, ResponseMeta, TopLogprobs
from router.proto import generate_pb2 as pb
from workers.protocol import TokenChunk

Kind = Literal["chat", "completion"]


# ---- requests -> bodies ----------------------------------------------------------------
def sampling_body(options: pb.SamplingOptions, kind: Kind) -> dict[str, Any]:
    """The request fields the client set; an unset one takes the HTTP default."""
    body = {
        field.name: list(value) if field.is_repeated else value
        for field, value in options.ListFields()
    }
    top = body.pop("logprobs", None)
    if top is not None:  # chat asks with a flag plus a count, completions with the count
        body |= {"logprobs": True, "top_logprobs": top} if kind == "chat" else {"logprobs": top}
    return body


def completion_body(request: pb.GenerateRequest) -> dict[str, Any]:
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


def chat_body(request: pb.ChatRequest) -> dict[str, Any]:
    """A ``/v1/chat/completions`` body."""
    body = sampling_body(request.sampling, "chat")
    body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
    if request.HasField("thinking"):
        body["chat_template_kwargs"] = {"thinking": request.thinking}
    if request.model:
        body["model"] = request.model
    return body


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


def usage_message(usage: dict[str, Any]) -> pb.Usage:
    """``ResponseBuilder.usage()`` as a message."""
    return pb.Usage(
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )


def _whole_choice(index: int, state: ChoiceState, meta: ResponseMeta) -> pb.Choice:
    choice = pb.Choice(
        index=index,
        text="".join(state.text),
        token_ids=state.token_ids,
        finish_reason=state.finish_reason or "",
    )
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


def stream_message(chunk: TokenChunk, meta: ResponseMeta) -> pb.GenerateStreamResponse | None:
    """The new output of ``chunk``'s sequence; None when the chunk carries nothing."""
    if not (chunk.text or chunk.token_ids or chunk.finished):
        return None
    choice = pb.Choice(
        index=chunk.index,
        text=chunk.text,
        token_ids=chunk.token_ids,
        finish_reason=(chunk.finish_reason or "") if chunk.finished else "",
    )
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
