"""How the server answers errors: always OpenAI's error object (`schemas.error_body`).

`ApiError` is what a handler raises (status, message, OpenAI's error type, headers such as
Retry-After); `job_error` maps an engine error to one (bad input 400, a required tier that
cannot be used 503; anything else is internal: 500). `EXCEPTION_HANDLERS` answers those,
the body's validation errors (400 not JSON, 415 not sent as JSON, 422 the wrong shape),
Starlette's own HTTP errors (an unknown path: 404) and any other exception (500).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from blend.server import schemas
from storage.tier import StoreUnavailable

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def bad_request(err: Exception) -> ApiError:
    """400 with the engine's (or the body's) own message, which names the fix."""
    return ApiError(400, str(err))


def timed_out(timeout_s: float) -> ApiError:
    """504: a generation ran past the server's request timeout."""
    return ApiError(504, f"the request took longer than {timeout_s:g} s", "timeout")


def job_error(err: BaseException) -> ApiError | None:
    """The answer to an engine error that is the caller's or the store's to fix (None:
    an internal error, 500): bad input 400; a required tier that cannot be used 503."""
    if isinstance(err, ValueError | TypeError):
        return bad_request(err)
    if isinstance(err, StoreUnavailable):
        return ApiError(503, str(err), "store_unavailable")
    return None


async def api_error(_request: Request, err: ApiError) -> Response:
    return JSONResponse(schemas.error_body(err.message, err.kind), status_code=err.status, headers=err.headers)


async def invalid_body(request: Request, err: RequestValidationError) -> Response:
    """A body FastAPI could not validate: 400 (not JSON), 415 (not sent as JSON) or 422 (the
    wrong shape: the first five problems, each with where it is)."""
    problems = err.errors()
    if any(p.get("type") == "json_invalid" for p in problems):
        return JSONResponse(schemas.error_body("the request body is not valid JSON"), status_code=400)
    kind = request.headers.get("content-type", "")
    if tuple(problems[0].get("loc", ())) == ("body",) and "json" not in kind.lower():
        return JSONResponse(schemas.error_body(f"send the body as JSON with Content-Type: application/json "
                                               f"(got {kind[:60] or 'none'!r})"), status_code=415)
    parts = []
    for p in problems[:5]:
        where = ".".join(str(x) for x in p.get("loc", ()) if x != "body")
        parts.append(f"{where or 'body'}: {p.get('msg', 'invalid')}")
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return JSONResponse(schemas.error_body("; ".join(parts) + more), status_code=422)


async def http_error(_request: Request, err: StarletteHTTPException) -> Response:
    """Starlette's own errors (an unknown path, a body it could not parse) as OpenAI's object."""
    if err.status_code == 400 and err.detail == "There was an error parsing the body":
        return JSONResponse(schemas.error_body("the request body could not be parsed: send UTF-8 JSON (nested at "
                                               "most a few hundred levels) with Content-Type: application/json"),
                            status_code=400)
    return JSONResponse(schemas.error_body(str(err.detail), "not_found" if err.status_code == 404 else
                                           "invalid_request_error"), status_code=err.status_code)


async def internal_error(_request: Request, err: Exception) -> Response:
    log.exception("internal error")
    return JSONResponse(schemas.error_body(f"internal error ({type(err).__name__})", "internal_error"),
                        status_code=500)


EXCEPTION_HANDLERS: dict[type[Exception], Callable[[Request, Any], Awaitable[Response]]] = {
    ApiError: api_error,
    RequestValidationError: invalid_body,
    StarletteHTTPException: http_error,
    Exception: internal_error,
}
