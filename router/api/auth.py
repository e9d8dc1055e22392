"""Optional API-key authentication of the inference routes, HTTP and gRPC alike.

The key is read once, when the router starts, from ``$DSV3SERVE_API_KEY`` or from the
variable that ``router.api_key_env`` names (then it must be set). Without a key every
route is open. With one, HTTP ``/v1/*`` needs ``Authorization: Bearer <key>`` and gRPC
Generate/ChatComplete need the metadata ``authorization: Bearer <key>``; ``GET /health``
and the gRPC ``Health`` stay open for probes.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from starlette.responses import JSONResponse

from dsv3serve.settings import Settings
from router.api.errors import error_body
from router.config import ConfigError

MISSING_KEY = (
    "You didn't provide an API key. Send it in the Authorization header using Bearer "
    "auth (Authorization: Bearer YOUR_KEY)."
)
WRONG_KEY = "Incorrect API key provided."


@dataclass(frozen=True, repr=False)
class APIKeyAuth:
    """The router's API key (None: authentication is off)."""

    key: bytes | None

    @classmethod
    def from_env(cls, key_env: str | None, environ: Mapping[str, str] | None = None) -> APIKeyAuth:
        """The key from ``environ[key_env]``, or from ``$DSV3SERVE_API_KEY`` if not named
        (``environ``: default the process environment, read through dsv3serve.settings).

        Raises ConfigError when ``key_env`` names a variable that is unset or empty: a
        key that was asked for must not silently turn authentication off.
        """
        value = Settings.from_env(environ, api_key_env=key_env).api_key
        if key_env is not None and not value:
            raise ConfigError(
                f"router.api_key_env: expected environment variable {key_env} to hold the "
                "API key, found it unset or empty"
            )
        return cls(value.encode() if value else None)

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def refusal(self, authorization: str | None) -> str | None:
        """Why ``authorization`` (an ``Authorization`` value) is refused; None if allowed."""
        if self.key is None:
            return None
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return MISSING_KEY
        if not hmac.compare_digest(token.encode(), self.key):
            return WRONG_KEY
        return None

    def __repr__(self) -> str:  # never print the key
        return f"APIKeyAuth(enabled={self.enabled})"


def unauthorized_response(reason: str) -> JSONResponse:
    """HTTP 401 with the OpenAI error body and ``WWW-Authenticate: Bearer``."""
    body = error_body(reason, "authentication_error", None, "invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def metadata_value(metadata: Sequence[tuple[str, str | bytes]], key: str) -> str | None:
    """The first value of ``key`` in gRPC invocation metadata (keys are lower case)."""
    for name, value in metadata:
        if name == key:
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None
