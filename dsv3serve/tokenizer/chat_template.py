"""Pure-Python renderer of the published DeepSeek-V3 and DeepSeek-R1 chat templates.

The output is byte-identical to the jinja `chat_template` shipped in each model's
`tokenizer_config.json` for every conversation those templates accept; the tests
render both side by side. The published templates keep two flags for the whole
conversation rather than per message ("a tool call was already rendered", "a tool
output was already rendered"), so a second tool-calling assistant turn is rendered
without its `<｜Assistant｜><｜tool▁calls▁begin｜>` prefix, and V3 closes the call list
after every call but the first. Those quirks are reproduced on purpose: the prompt
must be the one the model was served with everywhere else.

``render_chat_pieces`` gives the same prompt as :class:`Piece` spans that say which text
came from the messages (``is_content``) and which is template markup, so a tokenizer can
keep special-token strings typed into a message from becoming special tokens. A message
with ``"trusted": True`` (server-written, e.g. the tools prompt) renders as markup.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ChatFlavor = Literal["deepseek-v3", "deepseek-r1"]
Message = Mapping[str, Any]

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TAG = "<｜User｜>"
ASSISTANT_TAG = "<｜Assistant｜>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
THINK_START = "<think>"
THINK_END = "</think>"

_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Piece:
    """A span of a rendered prompt: message text (``is_content``) or template markup."""

    text: str
    is_content: bool


@dataclass
class _RenderState:
    """Mirror of the template's `namespace`; lives for one `render_chat` call."""

    flavor: ChatFlavor
    parts: list[Piece] = field(default_factory=list)
    after_tool_output: bool = False  # ns.is_tool
    tool_call_rendered: bool = False  # ns.is_first (never reset by the template)
    tool_output_rendered: bool = False  # not ns.is_output_first (never reset either)

    def mark(self, text: str) -> None:
        """Append template markup."""
        self.parts.append(Piece(text, False))

    def say(self, text: str, trusted: bool = False) -> None:
        """Append text taken from a message (markup when the message is ``trusted``)."""
        self.parts.append(Piece(text, not trusted))

    def extend(self, pieces: Sequence[Piece]) -> None:
        self.parts.extend(pieces)


def _text(message: Message, index: int, *, optional: bool = False) -> str | None:
    """Content as a string; OpenAI-style lists of text parts are concatenated."""
    content = message.get("content")
    if content is None and optional:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_part(p) for p in content):
        return "".join(part["text"] for part in content)
    raise ValueError(
        f"expected messages[{index}] ({message.get('role')}) content to be a string or a "
        f"list of text parts, got {type(content).__name__}"
    )


def _is_text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "text" and "text" in part


def _strip_reasoning(content: str) -> str:
    """Drop everything up to the last `</think>`, as the R1 template does for history."""
    return content.split(THINK_END)[-1]


def _render_system(state: _RenderState, messages: Sequence[Message]) -> None:
    """Every system message's text, joined with a blank line."""
    system = [(i, m) for i, m in enumerate(messages) if m["role"] == "system"]
    for n, (index, message) in enumerate(system):
        if n:
            state.mark("\n\n")
        state.say(_text(message, index) or "", trusted=message.get("trusted") is True)


def _format_call(call: Mapping[str, Any]) -> list[Piece]:
    function = call["function"]
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return [
        Piece(TOOL_CALL_BEGIN, False),
        Piece(str(call.get("type", "function")), True),
        Piece(TOOL_SEP, False),
        Piece(function["name"], True),
        Piece("\n```json\n", False),
        Piece(arguments, True),
        Piece("\n```" + TOOL_CALL_END, False),
    ]


def _render_user(state: _RenderState, message: Message, index: int) -> None:
    state.after_tool_output = False
    state.mark(USER_TAG)
    state.say(_text(message, index) or "")


def _render_tool_calls_v3(state: _RenderState, calls: Sequence[Mapping[str, Any]]) -> None:
    for call in calls:
        if not state.tool_call_rendered:
            state.mark(ASSISTANT_TAG + TOOL_CALLS_BEGIN)
            state.extend(_format_call(call))
            state.tool_call_rendered = True
        else:
            state.mark("\n")
            state.extend(_format_call(call))
            state.mark(TOOL_CALLS_END + EOS_TOKEN)


def _render_tool_calls_r1(
    state: _RenderState, calls: Sequence[Mapping[str, Any]], content: str | None
) -> None:
    for call in calls:
        if not state.tool_call_rendered:
            state.mark(ASSISTANT_TAG)
            state.say(content or "")
            state.mark(TOOL_CALLS_BEGIN)
            state.tool_call_rendered = True
        else:
            state.mark("\n")
        state.extend(_format_call(call))
    state.mark(TOOL_CALLS_END + EOS_TOKEN)


def _render_assistant_text(state: _RenderState, content: str) -> None:
    if state.after_tool_output:
        state.mark(TOOL_OUTPUTS_END)
        state.say(content)
        state.mark(EOS_TOKEN)
        state.after_tool_output = False
        return
    if state.flavor == "deepseek-r1":
        content = _strip_reasoning(content)
    state.mark(ASSISTANT_TAG)
    state.say(content)
    state.mark(EOS_TOKEN)


def _render_assistant(state: _RenderState, message: Message, index: int) -> None:
    content = _text(message, index, optional=True)
    calls = message.get("tool_calls") or []
    # V3 takes the tool-call branch when content is None, R1 when tool_calls is present.
    is_call_turn = content is None if state.flavor == "deepseek-v3" else bool(calls)
    if is_call_turn:
        if not calls:
            raise ValueError(
                f"expected messages[{index}] (assistant) to have content or tool_calls"
            )
        state.after_tool_output = False
        if state.flavor == "deepseek-v3":
            _render_tool_calls_v3(state, calls)
        else:
            _render_tool_calls_r1(state, calls, content)
        return
    if content is None:
        raise ValueError(f"expected messages[{index}] (assistant) content to be a string, got None")
    _render_assistant_text(state, content)


def _render_tool(state: _RenderState, message: Message, index: int) -> None:
    state.after_tool_output = True
    if not state.tool_output_rendered:
        state.mark(TOOL_OUTPUTS_BEGIN)
        state.tool_output_rendered = True
    elif state.flavor == "deepseek-v3":
        state.mark("\n")
    state.mark(TOOL_OUTPUT_BEGIN)
    state.say(_text(message, index) or "")
    state.mark(TOOL_OUTPUT_END)


def _check_roles(messages: Sequence[Message]) -> None:
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"expected messages[{index}].role to be one of {_ROLES}, got {role!r}")


def render_chat(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    flavor: ChatFlavor = "deepseek-v3",
    thinking: bool | None = None,
    bos_token: str = BOS_TOKEN,
) -> str:
    """The prompt of ``render_chat_pieces`` as one string (its arguments are the same)."""
    pieces = render_chat_pieces(
        messages,
        add_generation_prompt=add_generation_prompt,
        flavor=flavor,
        thinking=thinking,
        bos_token=bos_token,
    )
    return "".join(piece.text for piece in pieces)


def render_chat_pieces(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    flavor: ChatFlavor = "deepseek-v3",
    thinking: bool | None = None,
    bos_token: str = BOS_TOKEN,
) -> list[Piece]:
    """Render an OpenAI-style conversation into the DeepSeek prompt string.

    Args:
        messages: dicts with `role` (system/user/assistant/tool) and `content`; assistant
            turns may carry OpenAI `tool_calls` (`{"type", "function": {"name",
            "arguments"}}`). All system messages are joined with a blank line and placed
            right after BOS, as the published templates do.
        add_generation_prompt: end with `<｜Assistant｜>` (not after a trailing tool output).
        flavor: which published template to reproduce. `"deepseek-r1"` also strips the
            reasoning (everything up to the last `</think>`) from assistant history.
        thinking: append `<think>\\n` after the generation prompt; defaults to True for
            the R1 flavor (as its template does) and False for V3.
        bos_token: the BOS string; the output starts with it, so encode without adding
            another one.

    Returns:
        The prompt's pieces (joined: the prompt text, starting with the BOS string).
    """
    _check_roles(messages)
    state = _RenderState(flavor=flavor)
    state.mark(bos_token)
    _render_system(state, messages)
    renderers = {"user": _render_user, "assistant": _render_assistant, "tool": _render_tool}
    for index, message in enumerate(messages):
        render = renderers.get(message["role"])
        if render is not None:
            render(state, message, index)
    if state.after_tool_output:
        state.mark(TOOL_OUTPUTS_END)
    elif add_generation_prompt:
        think = flavor == "deepseek-r1" if thinking is None else thinking
        state.mark(ASSISTANT_TAG + (THINK_START + "\n" if think else ""))
    return state.parts
