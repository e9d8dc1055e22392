"""The environment variables dsv3serve reads, in one typed place.

Every lookup of the process environment goes through :meth:`Settings.from_env`; no
other module reads ``os.environ``. Imports no torch, so the router may use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "DSV3SERVE_CACHE"
API_KEY_ENV = "DSV3SERVE_API_KEY"
FUSED_NORM_QUANT_ENV = "DSV3SERVE_FUSED_NORM_QUANT"
_OFF = ("0", "false", "off", "no")


@dataclass(frozen=True, repr=False)
class Settings:
    """The process environment as dsv3serve sees it, read once per call of ``from_env``."""

    cache_dir: Path
    """``$DSV3SERVE_CACHE``: where the tiny checkpoints, config presets and the built-in
    tokenizer are written once and reused (default ``~/.cache/dsv3serve``)."""

    api_key: str
    """The router's API key, stripped: ``$DSV3SERVE_API_KEY``, or the variable that
    ``router.api_key_env`` names instead. Empty: unset (authentication off unless a
    variable was named, see :class:`router.auth.APIKeyAuth`)."""

    fused_norm_quant: bool = True
    """``$DSV3SERVE_FUSED_NORM_QUANT``: ``0``/``false``/``off``/``no`` turns off the fused
    residual add + RMSNorm + FP8 quantisation kernel in the decoder layers (the default
    :class:`dsv3serve.model.deepseek_v3.ModelOptions` reads it); on otherwise."""

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, api_key_env: str | None = None
    ) -> Settings:
        """Read the settings from ``environ`` (default: this process's environment).

        ``api_key_env`` names the variable that holds the API key in place of
        ``$DSV3SERVE_API_KEY``.
        """
        env = os.environ if environ is None else environ
        cache = env.get(CACHE_ENV)
        return cls(
            cache_dir=Path(cache) if cache is not None else Path.home() / ".cache" / "dsv3serve",
            api_key=env.get(api_key_env or API_KEY_ENV, "").strip(),
            fused_norm_quant=env.get(FUSED_NORM_QUANT_ENV, "1").strip().lower() not in _OFF,
        )

    def __repr__(self) -> str:  # never print the key
        key = "set" if self.api_key else "unset"
        return (
            f"Settings(cache_dir={str(self.cache_dir)!r}, api_key={key}, "
            f"fused_norm_quant={self.fused_norm_quant})"
        )
