"""Errors in OpenAI's schema: `{"error": {"message", "type", "param", "code"}}`.

Bad input is a 400 `invalid_request_error` whose `param` names the field (and whose message starts
with it); an unknown model a 404 `model_not_found`; a missing or wrong API key a 401; an overloaded
or dead engine a 503 (`Retry-After` when retrying can help); a bug a 500 `server_error` whose body
says only "internal server error" and an id, the traceback being logged under that id
(`internal_error`): the exception's text may hold what a client must not see.
"""

from __future__ import annotations

import re
import uuid

from starlette.responses import JSONResponse

from swiftkv_fast.entrypoints.protocol import ErrorInfo, ErrorResponse
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

# what SamplingParams and swiftkv_fast.inputs put before the field a message is about
_PREFIX = re.compile(r"^(?:request \d+: )?(sampling_params\.)?")
_FIELD = re.compile(r"^[A-Za-z_]+")


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )
        return JSONResponse(body.model_dump(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None, where: str | None = None) -> APIError:
    """A 400 about `param`; the message starts with `where` (default: `param`), e.g. "prompt[1]"."""
    where = where or param
    if where is not None and not message.startswith(where):
        message = f"{where}: {message}"
    return APIError(message, 400, param=param)


def from_input_error(e: Exception, param: str | None = None, where: str | None = None) -> APIError:
    """A 400 from a TypeError / ValueError of SamplingParams or swiftkv_fast.inputs, without their
    "request i: " and "sampling_params." prefixes. An error about the prompt is about `param` (the
    request's prompt field; `where` locates it), one about a sampling parameter names that parameter."""
    text = str(e)
    prefix = _PREFIX.match(text)
    message = text[prefix.end() :]
    if param is not None and not prefix.group(1):
        return bad_request(message, param, where)
    name = _FIELD.match(message)
    return APIError(message, 400, param=name.group(0) if name else None)


def internal_error(e: BaseException, where: str) -> APIError:
    """A 500 for a bug: `e`'s traceback is logged under a fresh id, which the answer names instead
    of the exception's text. `where` says what failed (a route)."""
    error_id = uuid.uuid4().hex[:16]
    logger.error("internal server error %s in %s", error_id, where, exc_info=e)
    return APIError(f"internal server error (id {error_id}: the server log has the details)", 500)
