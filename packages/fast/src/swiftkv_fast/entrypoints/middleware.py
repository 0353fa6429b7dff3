"""The server's ASGI middleware (pure ASGI: none of them wraps or buffers a streaming response).

- `APIKeyMiddleware`: with --api-key, a /v1 request needs exactly one "Authorization: Bearer KEY"
  header; a missing, wrong or repeated one is a 401 (two headers are ambiguous: refused, whichever
  is right).
- `RequestBodyLimitMiddleware`: a body over --max-request-body-bytes is a 413 before it is read
  whole: at once when its Content-Length says so, else as soon as the bytes received pass the limit.
- `InternalErrorMiddleware`: an exception no handler turned into a response is a bug: a 500 naming
  an id, the traceback logged under it (errors.internal_error), and nothing re-raised to the
  server, which would log a second traceback.
"""

from __future__ import annotations

import secrets

from swiftkv_fast.entrypoints.errors import APIError, internal_error


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = [value for name, value in scope["headers"] if name.lower() == b"authorization"]
            if len(given) > 1:
                error = APIError(
                    f"{len(given)} Authorization headers: send exactly one (Authorization: Bearer KEY)",
                    401,
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
            if not secrets.compare_digest(given[0] if given else b"", self.expected):
                error = APIError(
                    "invalid or missing API key (Authorization: Bearer KEY)", 401, code="invalid_api_key"
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestBodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, what: str) -> APIError:
        return APIError(
            f"the request body ({what}) is over the server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes)",
            413,
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:  # the server checked it is a number
            await self._too_large(f"Content-Length {length.decode()}").response()(scope, receive, send)
            return
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # raised where the app reads: its handler answers
                    raise self._too_large(f"{received} bytes received so far")
            return message

        await self.app(scope, receive_within_limit, send)


class InternalErrorMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_noting_start(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as e:
            error = internal_error(e, f"{scope['method']} {scope['path']}")
            if not started:  # else the client sees the response cut short: nothing else can be sent
                await error.response()(scope, receive, send)
