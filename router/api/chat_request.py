"""A chat request's prompt, constraint and output split, decided once before it runs.

``plan_chat`` renders the conversation (tools included) through the DeepSeek chat
template, notes whether the prompt opened ``<think>``, asks for the structural tag a
forced ``tool_choice`` needs, and says how the output is to be split
(``reasoning_content`` / ``content`` / ``tool_calls``).

The reasoning split (``--reasoning-parser``, SGLang's names) is on when the server has a
parser and the request leaves ``separate_reasoning`` true: ``deepseek-r1`` splits every
response (from the first token when the prompt opened ``<think>``, else only an output
that opens ``<think>``); ``deepseek-v3`` splits only when the prompt opened ``<think>``
(``chat_template_kwargs: {"thinking": true}``, or an R1 template's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dsv3serve.sampling.constraint import Constraint
from dsv3serve.sampling.sampling_params import SamplingParams
from dsv3serve.tokenizer.chat_template import THINK_START, Piece
from dsv3serve.tokenizer.tokenizer import Tokenizer
from router.api.chat_output import OutputParsing, ReasoningMode
from router.api.chat_tools import NamedToolChoice
from router.api.errors import bad_request
from router.api.openai_protocol import ChatCompletionRequest
from router.api.tool_constraints import (
    structural_tag_json,
    tool_call_structural_tag,
)

ReasoningParserName = Literal["deepseek-r1", "deepseek-v3"]


@dataclass(frozen=True)
class ChatPlan:
    """What ``prepare`` needs beyond the sampling fields of a chat request."""

    prompt_ids: list[int]
    opens_reasoning: bool
    sampling_extra: dict[str, Any]
    reasoning: ReasoningMode | None
    tool_names: tuple[str, ...] | None
    max_tool_calls: int | None
    include_reasoning: bool

    def parsing(self, tokenizer: Tokenizer, params: SamplingParams) -> OutputParsing | None:
        """The output split for ``params``' decoding; None when the text stays whole."""
        if self.reasoning is None and self.tool_names is None:
            return None
        skip = params.skip_special_tokens
        return OutputParsing(
            reasoning=self.reasoning,
            include_reasoning=self.include_reasoning,
            tool_names=self.tool_names,
            max_tool_calls=self.max_tool_calls,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=skip),
        )


def render_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[Piece]:
    """The prompt: the conversation and the offered tools through the template, as
    markup and message-content pieces."""
    text_with_calls = tokenizer.chat_flavor == "deepseek-r1"
    try:
        return tokenizer.chat_pieces(
            body.template_messages(text_with_calls), True, thinking=body.thinking
        )
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


def reasoning_mode(
    parser: ReasoningParserName | None, body: ChatCompletionRequest, opens_reasoning: bool
) -> ReasoningMode | None:
    """How the output's reasoning is found (see the module docstring); None: not split."""
    if parser is None or not body.separate_reasoning:
        return None
    if opens_reasoning:
        return "forced"
    return "detect" if parser == "deepseek-r1" else None


def _constraint(body: ChatCompletionRequest, opens_reasoning: bool) -> dict[str, Constraint]:
    """``{"constraint": ...}`` (a structural tag) when ``tool_choice`` needs one."""
    tools, choice = body.tools or [], body.effective_tool_choice
    tag = tool_call_structural_tag(tools, choice, body.parallel_tool_calls, opens_reasoning)
    if tag is None:
        return {}
    return {"constraint": Constraint(kind="structural_tag", text=structural_tag_json(tag))}


def _max_tool_calls(body: ChatCompletionRequest) -> int | None:
    one = isinstance(body.effective_tool_choice, NamedToolChoice) or not body.parallel_tool_calls
    return 1 if one else None


def plan_chat(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    parser: ReasoningParserName | None,
    specials_in_content: bool = False,
) -> ChatPlan:
    """Render, tokenize and decide the constraint and output split of ``body``.
    ``specials_in_content``: special-token strings in messages become the tokens (vLLM's
    behaviour) instead of staying text."""
    pieces = render_prompt(tokenizer, body)
    opens_reasoning = "".join(piece.text for piece in pieces).endswith(THINK_START + "\n")
    reads_tools = bool(body.tools) and body.effective_tool_choice != "none"
    return ChatPlan(
        prompt_ids=tokenizer.encode_prompt(pieces, specials_in_content),
        opens_reasoning=opens_reasoning,
        sampling_extra=_constraint(body, opens_reasoning),
        reasoning=reasoning_mode(parser, body, opens_reasoning),
        tool_names=tuple(t.function.name for t in body.tools or []) if reads_tools else None,
        max_tool_calls=_max_tool_calls(body),
        include_reasoning=body.include_reasoning,
    )
