"""What every HTTP server of the package shares (the instance server, the router gateway, the rollout
service): errors answered in OpenAI's body (`ApiError`, `json_errors`), the API-key check
(`key_checker`), and JSON bodies read within a limit (`read_json`)."""
from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["ApiError", "json_errors", "key_checker", "read_json"]


class ApiError(Exception):
    """An error answered as OpenAI's error body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
                             503: "service_unavailable"}.get(status, "invalid_request_error" if status < 500
                                                             else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def key_checker(api_keys: Sequence[str]):
    """`caller(request)`: the request's API key (`Authorization: Bearer <key>`, or `x-api-key: <key>`
    as Anthropic's clients send it), or ApiError 401 unless it is one of `api_keys` (compared in
    constant time, every key)."""
    keys = [k.encode() for k in api_keys]

    def caller(request: Request) -> str:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "").strip()
        if not key or sum(hmac.compare_digest(key.encode(), k) for k in keys) == 0:
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>', or 'x-api-key: <key>')",
                           code="invalid_api_key")
        return key
    return caller


def json_errors(app: FastAPI, body: Callable[[Request, ApiError], dict] | None = None) -> None:
    """Every error of `app` answered as a JSON error body (`body(request, error)`; default OpenAI's,
    `ApiError.body`): ApiError, unknown routes and methods, a declared parameter FastAPI refuses (400
    naming it, not FastAPI's 422), and bugs (500, logged; no traceback reaches the client)."""
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(body(request, e) if body is not None else e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid_parameter(request: Request, e: RequestValidationError):  # e.g. the probe's `kind`
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"][1:]) or None  # loc: ("query", "kind")
        message = f"'{param}' is invalid: {err['msg']}" if param else f"the request is invalid: {err['msg']}"
        return await _api_error(request, ApiError(400, message[:300], param, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):  # unknown route, wrong method
        return await _api_error(request, ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        logging.exception("request failed")
        return await _api_error(request, ApiError(500, f"internal error ({type(e).__name__})"))


async def read_json(request: Request, limit: int, empty: Any = None) -> Any:
    """The request body as JSON; ApiError 413 past `limit` bytes, 400 when it is not JSON (an empty
    body is `empty` where that is given)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body is {size} bytes, over the limit of {limit}", code="body_too_large")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    if empty is not None and not any(chunks):
        return empty
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, a 5000-digit number, deep nesting
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
