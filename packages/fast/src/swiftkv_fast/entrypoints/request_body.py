"""The body of an API request: JSON only, decoded and validated into a request model.

Nothing a client sends is a 500. A content type other than `application/json` is a 415 (vLLM's
rule: a web page can make a browser POST `text/plain` to a local server without a CORS preflight).
A body that cannot be made into a request is a 400 in OpenAI's error format, whatever fails: bad
UTF-8 or JSON, nesting deeper than Python's recursion limit, an integer over Python's digit limit,
a field of the wrong type or value. Text that is not valid Unicode (a lone UTF-16 surrogate such as
"\\ud800", which JSON can spell but no tokenizer can encode) is a 400 naming the field and character.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from swiftkv_fast.entrypoints.errors import APIError, bad_request

JSON_MEDIA_TYPE = "application/json"
# what pydantic puts in an error's location for the member of a union that failed
_UNION_TAGS = {"str", "int", "float", "bool"}
# a JSON escape of a UTF-16 surrogate: only then can the decoded body hold a lone one
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_json_content_type(raw_request: Request) -> None:
    """415 unless the Content-Type is application/json (parameters such as charset aside)."""
    content_type = raw_request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise APIError(
            f"Unsupported Media Type: only '{JSON_MEDIA_TYPE}' is allowed, got {content_type or 'none'!r}",
            415,
        )


async def parse_body(raw_request: Request, model: type[BaseModel]):
    """The JSON body as `model`; 415 for another content type, a 400 naming the field otherwise."""
    check_json_content_type(raw_request)
    raw = await raw_request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError("the request body is not valid JSON: it is nested too deeply", 400) from None
    except Exception as e:  # JSONDecodeError, UnicodeDecodeError, ValueError (digit limit), ...
        raise APIError(f"the request body is not valid JSON: {e}", 400) from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}", 400)
    if _SURROGATE_ESCAPE.search(raw):
        check_unicode(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [p for p in err["loc"] if isinstance(p, int) or (p.isidentifier() and p not in _UNION_TAGS)]
        message = "this field is required" if err["type"] == "missing" else err["msg"]
        raise bad_request(
            message.removeprefix("Value error, "), str(loc[0]) if loc else None, location(loc) or None
        ) from None
    except Exception as e:  # anything else validation raises is still about the body
        raise APIError(f"there was an error parsing the body: {type(e).__name__}", 400) from None


def check_unicode(body: dict) -> None:
    """400 at the first string (key or value) holding a lone surrogate; iterative, so any depth that
    JSON decoding accepted is walked without recursion."""
    stack: list[tuple[list, object]] = [([], body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(path, key, "a key")
                stack.append((path + [key], item))
        elif isinstance(value, list):
            stack.extend((path + [i], item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(path, value, "the text")


def _check_text(path: list, text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = location(path) or "the request body"
        code = ord(text[e.start])
        raise bad_request(
            f"{what} is not valid Unicode: a lone surrogate U+{code:04X} at character {e.start}",
            str(path[0]) if path else None,
            where,
        ) from None


def location(path: list) -> str:
    """A field's place as error messages name it: messages[0].content, prompt[1]."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
