"""Reading a request body into a JSON object, refusing hostile bodies with a 4xx.

Every limit is checked before the parser sees the bytes, or on what the parser gives
back: the size (413), how long the client takes to send it (408), nesting depth (400,
checked on the raw bytes so a deep body never reaches the recursive parser), UTF-8 and
lone surrogates written as ``\\ud800`` escapes (400), and JSON syntax (400).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from dsv3serve.json_types import JSONObject
from router.api.errors import APIError, bad_request

# A JSON string: quotes around any run of non-quote, non-backslash bytes or escapes.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class BodyLimits:
    """What a body may be: at most ``max_bytes``, sent within ``read_timeout_s``, nested
    at most ``max_depth`` arrays/objects deep."""

    max_bytes: int = 1 << 20
    read_timeout_s: float = 30.0
    max_depth: int = 128


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")


def _too_slow(timeout_s: float) -> APIError:
    """408; ``Connection: close`` makes the HTTP server drop the half-sent request."""
    message = f"the request body was not received within {timeout_s:g} s"
    return APIError(408, message, code="request_timeout", headers={"Connection": "close"})


async def _read_bytes(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > max_bytes:
            raise _too_large(max_bytes)
        parts.append(part)
    return b"".join(parts)


def nests_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether arrays and objects in ``raw`` nest more than ``limit`` deep (brackets
    inside strings do not count). Linear time and no recursion, unlike the parser."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for byte in brackets:
        depth += 1 if byte in b"[{" else -1
        if depth > limit:
            return True
    return False


def _check_depth(raw: bytes, limit: int) -> None:
    if nests_deeper_than(raw, limit):
        raise bad_request(
            f"request body nests arrays/objects more than {limit} deep", code="invalid_json"
        )


def _check_no_lone_surrogates(body: Any, raw: bytes) -> None:
    """400 for a ``\\ud800``-style escape that does not form a pair: such a string
    cannot be encoded, tokenized or echoed back."""
    if b"\\u" not in raw and b"\\U" not in raw:
        return  # surrogates only arrive as escapes: raw UTF-8 cannot hold them
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"request body holds an unpaired UTF-16 surrogate escape: {exc.reason}",
            code="invalid_json",
        ) from None


def parse_json_object(raw: bytes, max_depth: int) -> JSONObject:
    """``raw`` as a JSON object; 400 for bad UTF-8, bad JSON, too deep, not an object."""
    _check_depth(raw, max_depth)
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc}", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of over 4300 digits
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"expected a JSON object as the body, got {type(body).__name__}")
    _check_no_lone_surrogates(body, raw)
    return body


async def read_json_object(request: Request, limits: BodyLimits) -> JSONObject:
    """The body as a JSON object: 413 over the size, 408 when the client is too slow to
    send it, 400 unless a UTF-8 JSON object within the depth limit."""
    try:
        raw = await asyncio.wait_for(_read_bytes(request, limits.max_bytes), limits.read_timeout_s)
    except asyncio.TimeoutError:
        raise _too_slow(limits.read_timeout_s) from None
    return parse_json_object(raw, limits.max_depth)
