"""DeepSeek tokenizer: `tokenizers` BPE plus BOS/EOS and chat rendering from the model dir."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from dsv3serve.json_types import JSONObject
from dsv3serve.tokenizer.chat_template import (
    THINK_END,
    ChatFlavor,
    Message,
    Piece,
    render_chat,
    render_chat_pieces,
)
from dsv3serve.tokenizer.files import TOKENIZER_CONFIG, TOKENIZER_JSON


def _token_content(value: Any, key: str) -> str:
    """`bos_token`/`eos_token` is either a string or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"expected {key} in {TOKENIZER_CONFIG} to be a string or AddedToken, got {value!r}"
    )


def _detect_flavor(config: JSONObject) -> ChatFlavor:
    template = config.get("chat_template") or ""
    r1 = isinstance(template, str) and THINK_END in template  # a list: named templates
    return "deepseek-r1" if r1 else "deepseek-v3"


class Tokenizer:
    """Byte-level BPE tokenizer of DeepSeek-V3/R1 loaded from a model directory.

    `vocab_size` counts the tokenizer's own ids (128,815 for V3/R1: 128,000 BPE tokens
    plus 818 added tokens); the model's embedding is padded to 129,280 rows, and ids
    in the padding range decode to nothing.
    """

    def __init__(self, backend: HFTokenizer, config: JSONObject, flavor: ChatFlavor) -> None:
        self._backend = backend
        self.bos_token = _token_content(config.get("bos_token"), "bos_token")
        self.eos_token = _token_content(config.get("eos_token"), "eos_token")
        self.bos_token_id = self._require_id(self.bos_token)
        self.eos_token_id = self._require_id(self.eos_token)
        self.chat_flavor: ChatFlavor = flavor
        self._plain: HFTokenizer | None = None  # see ``encode_pieces``
        self._added: re.Pattern[str] | None = None

    @classmethod
    def from_dir(cls, path: Path | str, flavor: ChatFlavor | None = None) -> Tokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` from `path`.

        `flavor` picks the chat template to reproduce; by default it is R1 when the
        directory's jinja template handles `</think>`, V3 otherwise.
        """
        path = Path(path)
        for name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
            if not (path / name).is_file():
                raise FileNotFoundError(f"expected {name} in tokenizer dir {path}, found none")
        config = json.loads((path / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
        backend = HFTokenizer.from_file(str(path / TOKENIZER_JSON))
        return cls(backend, config, flavor or _detect_flavor(config))

    def _require_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"expected token {token!r} in the vocabulary, found no id for it")
        return token_id

    @property
    def hf_backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for libraries that read its vocabulary)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of an exact token string (e.g. `"<｜User｜>"`), or None if unknown."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None for ids outside the vocabulary."""
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool) -> list[int]:
        """Token ids of `text`; with `add_bos`, BOS is prepended unless `text` starts with it.

        Special-token strings inside `text` (e.g. `<｜User｜>`) map to their ids.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_pieces(self, pieces: Sequence[Piece]) -> list[int]:
        """Token ids of a rendered prompt whose message text stays text: an added-token
        string (``<｜Assistant｜>``, BOS, ...) becomes its token only in markup; inside
        content it is tokenised like any other text, as OpenAI does. Text between two
        markup tokens is tokenised in one run, so a prompt without such strings in its
        content gets exactly the ids of ``encode``."""
        ids: list[int] = []
        run: list[str] = []
        for piece in pieces:
            if piece.is_content:
                run.append(piece.text)
                continue
            # split() with one group: even items are text, odd items added-token strings
            for i, part in enumerate(self._added_tokens().split(piece.text)):
                if i % 2 == 0:
                    run.append(part)
                    continue
                ids += self._encode_plain("".join(run))
                run = []
                ids.append(self._require_id(part))
        return ids + self._encode_plain("".join(run))

    def warm_up(self) -> None:
        """Build what ``encode_pieces`` makes on first use (a copy of the tokenizer without
        added tokens: ~0.7 s), so a server's first chat request does not wait for it."""
        self._added_tokens()
        self._encode_plain(" ")

    def _added_tokens(self) -> re.Pattern[str]:
        """A pattern that matches (and, in ``split``, keeps) every added-token string."""
        if self._added is None:
            added = self._backend.get_added_tokens_decoder().values()
            contents = sorted({token.content for token in added}, key=len, reverse=True)
            self._added = re.compile("(" + "|".join(map(re.escape, contents)) + ")")
        return self._added

    def _encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with no added token recognised (a copy without them)."""
        if not text:
            return []
        if self._plain is None:
            spec = json.loads(self._backend.to_str())
            spec["added_tokens"] = []
            self._plain = HFTokenizer.from_str(json.dumps(spec))
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool) -> list[list[int]]:
        """`encode` over many texts, tokenised in parallel by the Rust backend."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        ids = [encoding.ids for encoding in encodings]
        if add_bos:
            ids = [
                row if row[:1] == [self.bos_token_id] else [self.bos_token_id, *row] for row in ids
            ]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 byte runs become U+FFFD, unknown ids are dropped."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        thinking: bool | None = None,
    ) -> str:
        """Render `messages` with this model's chat template (see `render_chat`).

        The result starts with the BOS string: encode it with `encode(prompt, add_bos=True)`
        or `add_bos=False`, both give exactly one BOS.
        """
        return render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            flavor=self.chat_flavor,
            thinking=thinking,
            bos_token=self.bos_token,
        )

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        thinking: bool | None = None,
        specials_in_content: bool = False,
    ) -> list[int]:
        """Prompt ids of a conversation (one BOS). Special-token strings inside message
        content stay text (``encode_pieces``); ``specials_in_content`` makes them tokens,
        as vLLM and SGLang do (``apply_chat_template`` then ``encode``)."""
        pieces = self.chat_pieces(messages, add_generation_prompt, thinking=thinking)
        return self.encode_prompt(pieces, specials_in_content)

    def chat_pieces(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        thinking: bool | None = None,
    ) -> list[Piece]:
        """``apply_chat_template``'s prompt as markup and content pieces."""
        return render_chat_pieces(
            messages,
            add_generation_prompt=add_generation_prompt,
            flavor=self.chat_flavor,
            thinking=thinking,
            bos_token=self.bos_token,
        )

    def encode_prompt(self, pieces: Sequence[Piece], specials_in_content: bool) -> list[int]:
        """Ids of a rendered prompt: ``encode_pieces``, or with ``specials_in_content``
        the joined text through ``encode`` (special-token strings anywhere are tokens)."""
        if specials_in_content:
            return self.encode("".join(piece.text for piece in pieces), add_bos=False)
        return self.encode_pieces(pieces)
