"""Errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` and the
FastAPI handlers that produce them (bad parameters, pydantic validation, anything else)."""

from __future__ import annotations

import logging
import math
import secrets
import traceback
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.engine.entrypoints.async_llm import EngineDeadError
from baton.engine.errors import EngineBusyError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    """A 400 for an invalid parameter."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, first_param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        first_param = first_param or param
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{param}: {msg}" if param else msg)
    return "; ".join(parts) or "invalid request body", first_param


def install_error_handlers(app: FastAPI, on_reject: Callable[[], None] | None = None) -> None:
    """Maps every failure of a route to an OpenAI error response (never a crash).

    ``on_reject`` is called for each request refused for a client error (4xx ``APIError``
    or a body that fails validation).
    """

    def rejected() -> None:
        if on_reject is not None:
            on_reject()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.status < 500:
            rejected()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        rejected()
        message, param = _validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response(
            headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(EngineBusyError)
    async def _busy(request: Request, exc: EngineBusyError) -> JSONResponse:
        # Refused before it ran: the client retries after Retry-After (whole seconds).
        rejected()
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return APIError(503, str(exc), code="busy").response(headers={"Retry-After": retry})

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(503, str(exc)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The exception's text may quote the request (a prompt, a schema): it goes to the
        # log only, and the client gets a reference to find it there.
        ref = secrets.token_hex(6)
        where = "".join(traceback.format_tb(exc.__traceback__))
        # Prompts must not reach the log by default: the message only at DEBUG.
        logger.error(
            "request %s %s failed (ref %s): %s\n%s",
            request.method,
            request.url.path,
            ref,
            type(exc).__name__,
            where,
        )
        logger.debug("ref %s: %s", ref, exc)
        message = f"internal error (ref {ref}); the server log has the details"
        return APIError(500, message).response()
