"""Structured output with xgrammar: compiled grammars (cached) and per-sequence matchers.

:class:`GrammarCompiler` turns a :class:`~dsv3serve.sampling.constraint.Constraint` into an
xgrammar ``CompiledGrammar`` against the model's vocabulary, keyed by (kind, text,
strict) in a bounded LRU cache; an invalid constraint raises ``InvalidRequestError`` (a
400 for the client) saying what is wrong. xgrammar and the vocabulary tables load on the
first constrained request, so engines that never see one pay nothing.

JSON is compact unless the compiler is built with ``any_whitespace`` (the engine's
``disable_any_whitespace`` off): ``json_schema``, ``json_object`` and the ``json_schema``
contents of structural tags (tool-call arguments, ``compact_tags.py``) allow no whitespace
between elements but the separators ``", "`` and ``": "``, so a model cannot spend its
tokens on whitespace.

:class:`GrammarState` is one sequence's matcher. It accepts the sequence's committed
output tokens lazily (``sync``), so every step loop advances it the same way: before a
step samples a row, the row's matcher catches up with the row's output, then writes the
row's allowed-token bitmask (int32 ``[ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32``
set when token ``t`` is allowed). Speculative verification walks the drafts through the
matcher to get one bitmask per verified position, then rolls it back.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from dsv3serve.engine.compact_tags import compact_structural_tag
from dsv3serve.engine.intake import InvalidRequestError
from dsv3serve.sampling.constraint import Constraint
from dsv3serve.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarMatcher, TokenizerInfo
    from xgrammar import GrammarCompiler as XGrammarCompiler

_ANY_OBJECT = '{"type": "object"}'  # non-strict: any properties with any JSON values
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[15:21:41] /project/cpp/x.cc:83: "


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of ``vocab_size``."""
    return (vocab_size + 31) // 32


def full_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Host int32 [rows, W] with every token allowed (all bits set)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; see the module docstring.

    ``any_whitespace``: JSON may hold any whitespace between elements (xgrammar's and
    vLLM's default); off, it is compact.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        cache_size: int = 256,
        any_whitespace: bool = False,
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.cache_size, self.any_whitespace = cache_size, any_whitespace
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._compiler: XGrammarCompiler | None = None
        self._info: TokenizerInfo | None = None
        self._no_control: torch.Tensor | None = None  # see ``new_state``

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of ``constraint`` (cached); raises InvalidRequestError."""
        key = constraint  # frozen: hashed by kind, text and strict
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        compiled = self._compile(constraint)
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    @property
    def num_cached(self) -> int:
        """Compiled grammars held in the cache."""
        return len(self._cache)

    def new_state(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher over ``constraint``'s compiled grammar, for one sequence.

        A JSON state (``json_schema``, ``json_object``) also bans every token holding a raw
        control character (U+0000..U+001F): JSON strings may not contain them, and
        xgrammar's rule for length-bounded strings lets them through; compact JSON needs
        none elsewhere (with ``any_whitespace``, whitespace between elements is then
        spaces only: newline, tab and CR are control characters).
        """
        compiled = self.compile(constraint)  # xgrammar is imported by now
        import xgrammar

        matcher = xgrammar.GrammarMatcher(
            compiled, override_stop_tokens=[self.tokenizer.eos_token_id]
        )
        is_json = constraint.kind in ("json_schema", "json_object")
        ban = self._control_ban() if is_json else None
        return GrammarState(matcher, self.vocab_size, ban)

    def _control_ban(self) -> torch.Tensor:
        """Bitmask row [W] int32 clearing the tokens whose bytes hold a control character."""
        if self._no_control is None:
            row = full_bitmask(1, self.vocab_size)[0]
            _, info = self._load()
            for token, raw in enumerate(info.decoded_vocab[: self.vocab_size]):
                if any(byte < 0x20 for byte in raw):
                    row[token // 32] &= ~(1 << (token % 32))
            self._no_control = row
        return self._no_control

    def _compile(self, c: Constraint) -> CompiledGrammar:
        compiler = self._ensure_compiler()
        try:
            if c.kind == "json_schema":
                return compiler.compile_json_schema(
                    c.text, any_whitespace=self.any_whitespace, strict_mode=c.strict
                )
            if c.kind == "json_object":  # OpenAI's contract: an object, never a bare value
                return compiler.compile_json_schema(
                    _ANY_OBJECT, any_whitespace=self.any_whitespace, strict_mode=False
                )
            if c.kind == "regex":
                return compiler.compile_regex(c.text)
            if c.kind == "ebnf":
                return compiler.compile_grammar(c.text, root_rule_name="root")
            tag = c.text if self.any_whitespace else compact_structural_tag(c.text)
            return compiler.compile_structural_tag(tag)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {c.kind}: {_clean(exc)}") from None

    def _ensure_compiler(self) -> XGrammarCompiler:
        return self._load()[0]

    def _load(self) -> tuple[XGrammarCompiler, TokenizerInfo]:
        """The compiler and the vocabulary's TokenizerInfo (imports xgrammar once)."""
        if self._compiler is None or self._info is None:
            import xgrammar
            from transformers import PreTrainedTokenizerFast

            wrapped = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.hf_backend)
            info = xgrammar.TokenizerInfo.from_huggingface(
                wrapped, vocab_size=self.vocab_size, stop_token_ids=[self.tokenizer.eos_token_id]
            )
            self._info = info
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler, self._info


def _allows(row: torch.Tensor, token: int) -> bool:
    """Whether bitmask ``row`` (host int32 [W]) allows ``token``."""
    return 0 <= token < row.shape[0] * 32 and bool((int(row[token // 32]) >> (token % 32)) & 1)


def _clean(exc: BaseException) -> str:
    """xgrammar's message without the C++ source location it starts with."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class GrammarState:
    """One sequence's grammar matcher and how many of its output tokens it has accepted."""

    def __init__(
        self, matcher: GrammarMatcher, vocab_size: int, ban: torch.Tensor | None = None
    ) -> None:
        """``ban``: a bitmask row [W] ANDed into every row this state fills."""
        self.matcher, self.vocab_size, self.ban = matcher, vocab_size, ban
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        """Whether the structure is complete and its end (EOS) accepted."""
        return bool(self.matcher.is_terminated())

    def sync(self, output_ids: list[int]) -> None:
        """Accept the output tokens not accepted yet (all must be real, committed ids)."""
        for token in output_ids[self.num_accepted :]:
            if self.matcher.is_terminated():
                break  # tokens after the end are never emitted (the EOS stopped the output)
            if not self.matcher.accept_token(token):
                raise RuntimeError(
                    f"grammar matcher rejected committed token {token} at output position "
                    f"{self.num_accepted}: it was sampled without this sequence's mask (a bug)"
                )
            self.num_accepted += 1
        self.num_accepted = len(output_ids)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's allowed set into ``bitmask[row]`` (host int32 [R, W])."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.ban is not None:
            bitmask[row] &= self.ban

    def draft_masks(self, drafts: list[int]) -> tuple[list[int], torch.Tensor]:
        """The longest prefix of ``drafts`` the grammar allows (stopping before one that
        would end it), and one bitmask row per verified position of that prefix (its
        length + 1 rows: after the last token, after each kept draft). The matcher is
        left where it was."""
        rows = full_bitmask(len(drafts) + 1, self.vocab_size)
        self.fill(rows, 0)
        accepted = kept = 0
        for token in drafts:
            if not _allows(rows[kept], token) or not self.matcher.accept_token(token):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break  # the target picks the end itself, at the position before it
            kept += 1
            self.fill(rows, kept)
        if accepted:
            self.matcher.rollback(accepted)
        return drafts[:kept], rows[: kept + 1]
