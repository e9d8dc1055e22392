"""Structured output with xgrammar: compiled grammars (cached) and per-sequence matchers.

:class:`GrammarCompiler` turns a :class:`~dsv3serve.engine.constraint.Constraint` into an
xgrammar ``CompiledGrammar`` against the model's vocabulary, keyed by (kind, text,
strict) in a bounded LRU cache; an invalid constraint raises ``InvalidRequestError`` (a
400 for the client) saying what is wrong. xgrammar and the vocabulary tables load on the
first constrained request, so engines that never see one pay nothing.

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
from typing import Any

import torch

from dsv3serve.engine.constraint import Constraint
from dsv3serve.engine.intake import InvalidRequestError
from dsv3serve.tokenizer.tokenizer import Tokenizer

_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[15:21:41] /project/cpp/x.cc:83: "


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of ``vocab_size``."""
    return (vocab_size + 31) // 32


def full_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Host int32 [rows, W] with every token allowed (all bits set)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; see the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_rollback_tokens: int = 0,
        cache_size: int = 256,
    ) -> None:
        """``max_rollback_tokens``: how far matchers can step back (the draft length)."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_rollback_tokens = max_rollback_tokens
        self.cache_size = cache_size
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._xgr: Any = None
        self._compiler: Any = None

    def compile(self, constraint: Constraint) -> Any:
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

    def new_state(self, compiled: Any) -> GrammarState:
        """A fresh matcher over ``compiled`` for one sequence."""
        matcher = self._xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=[self.tokenizer.eos_token_id],
            max_rollback_tokens=self.max_rollback_tokens,
        )
        return GrammarState(matcher, self.vocab_size)

    def _compile(self, c: Constraint) -> Any:
        compiler = self._ensure_compiler()
        try:
            if c.kind == "json_schema":
                return compiler.compile_json_schema(
                    c.text, any_whitespace=False, strict_mode=c.strict
                )
            if c.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if c.kind == "regex":
                return compiler.compile_regex(c.text)
            if c.kind == "ebnf":
                return compiler.compile_grammar(c.text, root_rule_name="root")
            return compiler.compile_structural_tag(c.text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {c.kind}: {_clean(exc)}") from None

    def _ensure_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar
            from transformers import PreTrainedTokenizerFast

            wrapped = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.hf_backend)
            info = xgrammar.TokenizerInfo.from_huggingface(
                wrapped, vocab_size=self.vocab_size, stop_token_ids=[self.tokenizer.eos_token_id]
            )
            self._xgr = xgrammar
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def _allows(row: torch.Tensor, token: int) -> bool:
    """Whether bitmask ``row`` (host int32 [W]) allows ``token``."""
    return 0 <= token < row.shape[0] * 32 and bool((int(row[token // 32]) >> (token % 32)) & 1)


def _clean(exc: BaseException) -> str:
    """xgrammar's message without the C++ source location it starts with."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class GrammarState:
    """One sequence's grammar matcher and how many of its output tokens it has accepted."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
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
