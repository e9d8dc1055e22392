"""OpenAI wire shapes: request bodies (chat, legacy completions).

Field names and extensions follow vLLM / SGLang (``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``chat_template_kwargs``, and SGLang's ``regex`` / ``ebnf`` structured-output fields).
OpenAI fields this server cannot honour are refused with 400 (``router/api/openai_fields.py``);
other unknown fields are ignored and explicit ``null`` means "not given", as with vLLM.
Types are strict: ``"2"`` is not an int, ``"yes"`` not a bool, and ``1.0`` not an int.
Ranges are checked by SamplingParams, not here, so the limits live in one place;
``PARAM_NAMES`` maps its field names back to the request's.
Response bodies are built in ``router/api/openai_response.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, Strict, model_validator

from dsv3serve.sampling.constraint import Constraint
from dsv3serve.sampling.sampling_params import SamplingParams
from router.api.chat_tools import (
    ToolCall,
    ToolChoice,
    ToolDef,
    effective_choice,
    tool_problem,
    tools_system_prompt,
)
from router.api.request_part import RequestPart

Message = dict[str, Any]
TokenIdKey = Annotated[int, Strict(False)]  # JSON object keys are strings: "50256" is an id
TopLogprobs = list[list[tuple[int, float]]]  # per token: (token id, logprob) alternatives


class StreamOptions(RequestPart):
    include_usage: bool = False


class TextPart(RequestPart):
    """One part of a message's content; only text parts are accepted."""

    type: Literal["text"]
    text: str


class ChatMessage(RequestPart):
    """A conversation turn. ``developer`` is OpenAI's newer name for ``system``.

    An assistant turn may carry ``tool_calls`` instead of content; a ``tool`` turn is a
    call's result (``tool_call_id`` is accepted; the template places results by order).
    ``reasoning_content`` of earlier turns is not rendered, as the R1 template drops it.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages have them, not {self.role}")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: expected content in a {self.role} message, got none")
        return self

    def text(self) -> str | None:
        """The content with text parts joined; None for a call-only assistant turn."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self, text_with_calls: bool = True) -> Message:
        """The turn as the chat template takes it. ``text_with_calls`` False: a turn with
        tool calls renders as calls only (the published V3 template renders a turn's
        text or its calls, never both; R1's renders both)."""
        role = "system" if self.role == "developer" else self.role
        message: Message = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
            if not text_with_calls:
                message["content"] = None
        return message


class JSONSchemaFormat(RequestPart):
    """``response_format.json_schema``: the schema and whether it is strict."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool = False


class ResponseFormat(RequestPart):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema must be given exactly when type is 'json_schema'")
        return self

    def constraint(self) -> Constraint | None:
        """The engine constraint of this format (None for ``text``)."""
        if self.type == "json_object":
            return Constraint(kind="json_object")
        if self.json_schema is None:
            return None
        return Constraint.json_schema(self.json_schema.schema_, self.json_schema.strict)


class SamplingFields(RequestPart):
    """Fields shared by chat and completions requests."""

    PARAM_NAMES: ClassVar[dict[str, str]] = {
        "max_new_tokens": "max_tokens",
        "min_new_tokens": "min_tokens",
    }

    model: str | None = None
    user: str | None = None  # an end-user id: checked, then ignored (vLLM does the same)
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[TokenIdKey, float] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None

    def requested_max_tokens(self) -> int | None:
        """The completion budget the client asked for, if any."""
        return self.max_tokens

    def top_logprobs_k(self) -> int | None:
        """SamplingParams.logprobs: None for no logprobs, else the number of alternatives."""
        return None

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments, except ``max_new_tokens``."""
        same_name = SamplingParams.model_fields.keys() & type(self).model_fields.keys()
        given = {name: getattr(self, name) for name in same_name}
        given |= {"min_new_tokens": self.min_tokens, "logprobs": self.top_logprobs_k()}
        given |= {"constraint": self.constraint()}
        return {k: v for k, v in given.items() if v is not None}

    def constraint_fields(self) -> list[str]:
        """The structured-output fields the request sets (at most one is allowed)."""
        fields = [name for name in ("regex", "ebnf") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            fields.insert(0, "response_format")
        return fields

    def constraint(self) -> Constraint | None:
        """The structured-output constraint: ``response_format``, ``regex`` or ``ebnf``."""
        if self.regex is not None:
            return Constraint(kind="regex", text=self.regex)
        if self.ebnf is not None:
            return Constraint(kind="ebnf", text=self.ebnf)
        return None if self.response_format is None else self.response_format.constraint()

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def param_name(self, sampling_field: str) -> str:
        """The request field behind a SamplingParams field (for error ``param``)."""
        if sampling_field.split(".")[0] == "constraint":
            return (self.constraint_fields() or ["response_format"])[0]
        return self.PARAM_NAMES.get(sampling_field, sampling_field)

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for a request this server cannot honour, else None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        constraints = self.constraint_fields()
        if len(constraints) > 1:
            return constraints[1], f"give at most one of {', '.join(constraints)}"
        return None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions body."""

    PARAM_NAMES: ClassVar[dict[str, str]] = {
        "max_new_tokens": "max_tokens",
        "min_new_tokens": "min_tokens",
        "logprobs": "top_logprobs",
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True  # SGLang: False keeps <think>...</think> in content
    include_reasoning: bool = True  # vLLM: False leaves reasoning_content out

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def param_name(self, sampling_field: str) -> str:
        if sampling_field == "max_new_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().param_name(sampling_field)

    def unsupported(self) -> tuple[str, str] | None:
        problem = tool_problem(self.tools, self.tool_choice)
        if problem is not None:
            return problem
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        return super().unsupported()

    def template_messages(self, text_with_calls: bool = True) -> list[Message]:
        """The conversation as the DeepSeek chat template takes it, the tools (unless
        ``tool_choice`` is ``none``) offered in a last system message (server-written,
        so its tool-call markers are tokens: ``trusted``)."""
        messages = [m.as_template_message(text_with_calls) for m in self.messages]
        choice = self.effective_tool_choice
        if self.tools and choice != "none":
            text = tools_system_prompt(self.tools, choice, self.parallel_tool_calls)
            messages.append({"role": "system", "content": text, "trusted": True})
        return messages

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """``tool_choice``, or OpenAI's default: ``auto`` with tools, ``none`` without."""
        return effective_choice(self.tools, self.tool_choice)

    @property
    def thinking(self) -> bool | None:
        """``chat_template_kwargs.thinking`` (R1-style ``<think>`` prompt), if given."""
        value = (self.chat_template_kwargs or {}).get("thinking")
        return value if isinstance(value, bool) else None


class CompletionRequest(SamplingFields):
    """POST /v1/completions body. A list of prompts is split into one body per prompt
    before it gets here (``router/api/completion_batch.py``)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo and self.logprobs is not None:
            return "echo", (
                "echo with logprobs needs the prompt's logprobs, which this server does not "
                "compute; drop logprobs or echo"
            )
        if self.suffix:
            return "suffix", "suffix is not supported by this server"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); raises ValueError for a batch of several."""
        prompt = self.prompt
        is_batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        if not is_batch:
            return prompt  # type: ignore[return-value]
        if len(prompt) != 1:
            raise ValueError(
                f"expected one prompt per request, got a batch of {len(prompt)}; "
                "send each prompt as its own request"
            )
        return prompt[0]  # type: ignore[return-value]
