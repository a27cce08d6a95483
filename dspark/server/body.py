"""Reading a request body: bounded in size and in time, decoded as strict JSON whose every string is
valid Unicode. Whatever a client sends ends here as a dict or an APIError (or ClientGone), never as
an exception from deeper down (a RecursionError from deep nesting, a tokenizer's TypeError on a lone
surrogate)."""
from __future__ import annotations

import asyncio
import json
import math
import re

from starlette.requests import ClientDisconnect, Request

from dspark.server.errors import APIError, bad_request

# a JSON escape of a UTF-16 surrogate; only such escapes can put a lone surrogate into a parsed string
# (raw surrogate bytes are invalid UTF-8 and fail the parse), so bodies without one skip the walk
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class ClientGone(Exception):
    """The client disconnected before its request was read: there is nobody left to answer."""


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The raw body: 413 past `limit` bytes, 408 when it takes longer than `timeout_s` to arrive."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                       code="request_too_large")
    try:
        return await asyncio.wait_for(_read(request, limit), timeout_s)
    except asyncio.TimeoutError:
        # the rest of the body may still be on its way: close the connection rather than read it
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s.", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientGone from None


async def _read(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object: 400 for invalid JSON, non-finite numbers, nesting deeper than the
    parser's recursion limit, and strings that are not text (lone surrogates)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad_request("The JSON body is nested too deeply.", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    where = lone_surrogate(body) if _SURROGATE_ESCAPE.search(raw) else None
    if where is not None:
        raise bad_request(f"'{where}' contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                          "which is not valid Unicode text.", where, "invalid_text")
    return body


def lone_surrogate(value: object) -> str | None:
    """The path (e.g. messages[0].content) of a string in `value` holding a lone surrogate, or None.
    Iterative: the nesting may be as deep as the parser allowed."""
    stack: list[tuple[str, object]] = [("body", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _is_text(v):
                return path
        elif isinstance(v, dict):
            for key, item in v.items():
                if not _is_text(key):
                    return path
                stack.append((key if path == "body" else f"{path}.{key}", item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf; no sampling value or length means that
        raise ValueError(f"the number {text[:32]} is out of range")
    return value
