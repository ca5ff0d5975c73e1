"""Pure ASGI middleware (no BaseHTTPMiddleware: it would break streaming and disconnect
detection): the API key check and the request body size limit."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.engine.server.errors import error_body

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _start(status: int, payload: bytes, headers: list[tuple[bytes, bytes]]) -> Message:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            *headers,
        ],
    }


async def _send_error(
    send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    payload = json.dumps(body).encode()
    await send(_start(status, payload, headers or []))
    await send({"type": "http.response.body", "body": payload})


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <api_key>`` on every ``/v1`` path (401 otherwise).

    The comparison is constant-time. ``/health`` and ``/metrics`` stay open.
    """

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[], None]) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        self._on_reject()
        message = (
            "Incorrect API key provided." if given else "Missing API key (Authorization: Bearer)."
        )
        await _send_error(
            send,
            401,
            error_body(message, "invalid_request_error", None, "invalid_api_key"),
            [(b"www-authenticate", b"Bearer")],
        )


class BodyLimitMiddleware:
    """Answers 413 to a request body over ``max_bytes``: from its Content-Length when given,
    else while reading it. The body is read here (at most ``max_bytes``) and replayed to the
    app; later ``receive`` calls (disconnect) go to the server.

    The 413 goes out at once, complete (a client that waits before sending its body gets it),
    but the response is ended only after reading and dropping what a client still sends, up to
    ``drain_bytes`` or ``drain_timeout_s``: closing a connection with unread request bytes
    makes the kernel reset it, and a sending client would see the reset, not the 413. A body
    declared larger than that is not read at all.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_reject: Callable[[], None],
        drain_bytes: int | None = None,
        drain_timeout_s: float = 2.0,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = max(4 * max_bytes, 1 << 20) if drain_bytes is None else drain_bytes
        self.drain_timeout_s = drain_timeout_s
        self._on_reject = on_reject

    async def _drain(self, receive: Receive) -> None:
        """Reads and drops the rest of the body, at most ``drain_bytes``."""
        dropped = 0
        while dropped <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _too_large(self, receive: Receive, send: Send, size: str, drain: bool) -> None:
        self._on_reject()
        body = error_body(
            f"request body is {size} bytes; the limit is {self.max_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
        payload = json.dumps(body).encode()
        await send(_start(413, payload, [(b"connection", b"close")]))
        # All of the answer's bytes (its Content-Length is met), but the response stays open
        # while the rest of the body is dropped.
        await send({"type": "http.response.body", "body": payload, "more_body": True})
        if drain:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drain(receive), self.drain_timeout_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    drain = declared <= self.max_bytes + self.drain_bytes
                    await self._too_large(receive, send, str(declared), drain)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # Disconnected while sending: nobody to answer.
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                drain = message.get("more_body", False)
                await self._too_large(receive, send, f"more than {self.max_bytes}", drain)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
