"""IncrementalDetokenizer on the real DeepSeek-V3 tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3serve.tokenizer.detokenizer import IncrementalDetokenizer
from dsv3serve.tokenizer.files import write_tokenizer_files
from dsv3serve.tokenizer.tokenizer import Tokenizer

FFFD = "\ufffd"
TEXTS = [
    "深度求索发布了新的混合专家模型，总参数六千七百一十亿。",
    "🤗👨‍👩‍👧‍👦🇯🇵🏳️‍🌈👍🏽 emoji sequences",
    "日本語とEnglishの混在テキスト、絵文字🍣も。",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝛼𝛽𝛾 and CJK ext-B 𠀀𠀁𪚥",
    "Ｆｕｌｌｗｉｄｔｈ ｌｅｔｔｅｒｓ and combining: e\u0301 n\u0303",
    "ᚠᛇᚻ᛫ᛒᛦᚦ runes, ภาษาไทย, 한국어 텍스트",
    "def f():\n    return '🙂'  # ok\n",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("deepseek-v3")
    write_tokenizer_files(path)
    return Tokenizer.from_dir(path)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(token_id) for token_id in ids]


def test_test_texts_split_characters_across_tokens(tok: Tokenizer) -> None:
    """The fixtures must exercise hold-back: some tokens decode alone to a partial char."""
    split = [t for t in TEXTS if any(FFFD in tok.decode([i]) for i in tok.encode(t, add_bos=False))]
    assert len(split) >= 4


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_concatenate(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    pieces = _stream(detok, ids)
    assert detok.flush() == ""
    assert all(FFFD not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert detok.generated_ids == ids


def test_holds_back_partial_emoji_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("🤗", add_bos=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert _stream(detok, ids[:-1]) == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🤗"


def test_prompt_context_is_not_emitted(tok: Tokenizer) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "用中文回答 🙂"}])
    answer = "好的！这是答案：四十二 🎉"
    ids = tok.encode(answer, add_bos=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    pieces = _stream(detok, ids)
    assert "".join(pieces) + detok.flush() == answer
    assert all(FFFD not in piece for piece in pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    ids = [*tok.encode("答案是 42 ✅", add_bos=False), tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    text = "".join(_stream(detok, ids)) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert text.endswith(tok.eos_token) is not skip_special_tokens


def test_truncated_character_is_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤗", add_bos=False)[:-1]
    detok = IncrementalDetokenizer(tok)
    pieces = _stream(detok, ids)
    assert "".join(pieces).rstrip() == "ok"  # the space shares a token with the emoji
    tail = detok.flush()
    assert tail.endswith(FFFD)
    assert "".join(pieces) + tail == tok.decode(ids)


def test_add_many_equals_single_adds(tok: Tokenizer) -> None:
    ids = tok.encode(TEXTS[1], add_bos=False)
    assert IncrementalDetokenizer(tok).add_many(ids) == "".join(
        _stream(IncrementalDetokenizer(tok), ids)
    )


@settings(max_examples=150, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=40))
def test_random_unicode_round_trips(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    pieces = _stream(detok, ids)
    full = "".join(pieces) + detok.flush()
    assert full == tok.decode(ids)
    # A piece may carry U+FFFD only when the text itself contains one.
    assert FFFD in text or all(FFFD not in piece for piece in pieces)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_id_sequences_match_decode(tok: Tokenizer, data: st.DataObject) -> None:
    """Arbitrary ids, invalid UTF-8 and padding ids included, still sum to `decode`."""
    byte_ids = st.sampled_from(tok.encode("🤗😀你好é", add_bos=False))
    any_id = st.integers(0, 129279)
    ids = data.draw(st.lists(st.one_of(byte_ids, any_id), max_size=30))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    text = "".join(_stream(detok, ids)) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=skip)
