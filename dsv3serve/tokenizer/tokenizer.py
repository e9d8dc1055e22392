"""DeepSeek tokenizer: `tokenizers` BPE plus BOS/EOS and chat rendering from the model dir."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from dsv3serve.tokenizer.chat_template import THINK_END, ChatFlavor, Message, render_chat
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


def _detect_flavor(config: dict[str, Any]) -> ChatFlavor:
    template = config.get("chat_template") or ""
    return "deepseek-r1" if THINK_END in template else "deepseek-v3"


class Tokenizer:
    """Byte-level BPE tokenizer of DeepSeek-V3/R1 loaded from a model directory.

    `vocab_size` counts the tokenizer's own ids (128,815 for V3/R1: 128,000 BPE tokens
    plus 818 added tokens); the model's embedding is padded to 129,280 rows, and ids
    in the padding range decode to nothing.
    """

    def __init__(self, backend: HFTokenizer, config: dict[str, Any], flavor: ChatFlavor) -> None:
        self._backend = backend
        self.bos_token = _token_content(config.get("bos_token"), "bos_token")
        self.eos_token = _token_content(config.get("eos_token"), "eos_token")
        self.bos_token_id = self._require_id(self.bos_token)
        self.eos_token_id = self._require_id(self.eos_token)
        self.chat_flavor: ChatFlavor = flavor

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
    ) -> list[int]:
        """Prompt ids of a conversation: `apply_chat_template` then `encode`, one BOS."""
        prompt = self.apply_chat_template(messages, add_generation_prompt, thinking=thinking)
        return self.encode(prompt, add_bos=False)
