"""Errors reported to clients in OpenAI's format."""

from __future__ import annotations

import functools
import os
import re
from typing import Optional

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error reported to the client in OpenAI's format."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        message = scrub_paths(message)  # here, so every API's error format gets it
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


# an absolute path: "/" + a name, then more "/name" parts (quotes, spaces, ':' end it)
_PATH = re.compile(r"(?<![\w.~/-])(~|/[^\s'\"`/:,;()<>\[\]{}]+)((?:/[^\s'\"`/:,;()<>\[\]{}]*)+)")


@functools.lru_cache(maxsize=1)
def _top_folders() -> frozenset:
    """The folders at the filesystem's root, read once: a message may quote any path
    (a client's model name among them), and none of it is looked up on disk."""
    try:
        return frozenset(e.name for e in os.scandir("/") if e.is_dir())
    except OSError:
        return frozenset()


def scrub_paths(text: str) -> str:
    """`text` without this machine's folder names (an error a client sees may
    quote a path): /Users/me/models/x/config.json -> .../config.json. Only paths
    under a top-level folder that exists here, so URL paths (/v1/models) stay."""
    def short(m):
        root = m.group(1)
        if root != "~" and root[1:] not in _top_folders():
            return m.group(0)
        tail = m.group(2).rstrip("/").rsplit("/", 1)[-1]
        return ".../" + tail if tail else "..."

    return _PATH.sub(short, text)


def error_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code)


class ContextTooLong(APIError):
    """A prompt the model's context cannot hold: a 400 `context_length_exceeded` that
    also keeps the numbers (`tokens`: the prompt's count, or a bound on it), so each
    API can word it the way its clients recognise."""

    def __init__(self, message: str, param: str, tokens: int, limit: int):
        super().__init__(400, message, param, "context_length_exceeded")
        self.tokens, self.limit = tokens, limit

