"""Where a model's tokenizer lives, without loading the model (and without torch)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from dsv3serve.settings import Settings
from dsv3serve.tokenizer.files import TOKENIZER_JSON, write_tokenizer_files

# Built-in names whose tokenizer is the published DeepSeek-V3 one.
BUILTIN_MODELS = ("tiny", "deepseek-v3")


def tokenizer_dir(model: str) -> Path:
    """The directory holding ``model``'s tokenizer files.

    For a built-in name (the tiny model, a config preset) the published DeepSeek-V3
    tokenizer is written once to ``$DSV3SERVE_CACHE/tokenizer-deepseek-v3``; for a
    checkpoint directory it is that directory.
    """
    if model not in BUILTIN_MODELS:
        return Path(model)
    root = Settings.from_env().cache_dir
    path = root / "tokenizer-deepseek-v3"
    if not (path / TOKENIZER_JSON).exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-tok-"))
        write_tokenizer_files(staging)
        try:
            staging.rename(path)  # atomic: concurrent writers race safely
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return path
