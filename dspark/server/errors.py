"""APIError: a failed request as the OpenAI error object, {"error": {message, type, param, code}}."""
from __future__ import annotations

import json

from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error the client sees: HTTP status, message, the offending parameter and a short code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def wrong_type(param: str, expected: str, value: object) -> APIError:
    return APIError(422, f"'{param}' must be {expected}, got {_kind(value)}", param=param, code="invalid_type")


def _kind(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
