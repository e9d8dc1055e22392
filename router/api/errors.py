"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from dsv3serve.json_types import JSONObject
from workers.backend import BackendError

INVALID_REQUEST = "invalid_request_error"
INTERNAL_ERROR = "internal_error"
_MAX_ERRORS_SHOWN = 3
_MAX_INPUT_REPR = 80


class APIError(Exception):
    """A request the HTTP layer answers with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> JSONObject:
        """The JSON body OpenAI clients parse into their exception types."""
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> JSONObject:
    """``{"error": {...}}`` with every key present (``null`` where not applicable)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    """The HTTP response for ``err`` (with its headers, e.g. ``Retry-After``)."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def from_backend_error(exc: BackendError) -> APIError:
    """A backend's refusal, with the status and type the backend chose."""
    return APIError(exc.status, exc.message, exc.error_type)


def internal_error(exc: BaseException) -> APIError:
    """A 500 for an unexpected exception; the message names the exception type only."""
    return APIError(500, f"internal server error ({type(exc).__name__})", INTERNAL_ERROR)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_INPUT_REPR else text[: _MAX_INPUT_REPR - 3] + "..."


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "body"
    return f"{where}: {error['msg']} (got {_short_repr(error['input'])})"


def from_validation_error(exc: ValidationError) -> APIError:
    """400 naming the first offending top-level field as ``param``.

    The message lists up to three problems as ``<location>: <what is allowed> (got ...)``.
    """
    errors = exc.errors()
    shown = "; ".join(_describe(e) for e in errors[:_MAX_ERRORS_SHOWN])
    more = len(errors) - _MAX_ERRORS_SHOWN
    if more > 0:
        shown += f"; and {more} more"
    loc = errors[0]["loc"] if errors else ()
    return bad_request(f"invalid request: {shown}", str(loc[0]) if loc else None)
