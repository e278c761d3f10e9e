"""What every request passes before any work is done, as one ASGI middleware
(outermost, so nothing else runs first), plus the API key check and the
one-line request log.

- Host header allow-list: a DNS-rebinding page reaches 127.0.0.1 under its own
  domain name, so only IP literals, localhost names, this machine's name, the
  bound address and `--allowed-hosts` are served.
- Origin: a browser says where a page came from; a cross-origin page is served
  only if its origin was given with `--cors` (then with CORS headers).
- Content type: POST bodies must be application/json; forms and text/plain are
  exactly what a page can send without a CORS preflight.
- Body size: Content-Length is checked first, then bytes are counted while they
  arrive; the 413 goes out as soon as the limit is passed.

Every request gets one log line (RequestLog), also one cut by a shutdown that
does not wait for it (`cut_open`: status 499 and the reason).
"""

from __future__ import annotations

import ctypes
import hmac
import ipaddress
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

from starlette.requests import Request

from .errors import APIError

MAX_BODY = 64 << 20  # bytes; far above any context this runs
LARGE_BODY = 8 << 20  # bytes: after a request this large, freed memory is handed back to the system
STATS_KEY = "mlx_dflash.engine.stats"  # scope["state"] entry: the request's GenerationStats, for the log line
CUT_KEY = "mlx_dflash.cut"  # scope["state"] entry: why the server stopped the request (shutdown), for the log line
SENT_KEY = "mlx_dflash.sent"  # scope["state"] entry: tokens sent so far (the log line of a request cut short)


@dataclass
class AccessRules:
    """Which hosts and origins are served, and how large a body may be."""

    hosts: Tuple[str, ...] = ()  # extra Host names ("*" any, "*.example" a domain)
    origins: Tuple[str, ...] = ()  # cross-origin pages allowed ("*" any)
    max_body: int = MAX_BODY
    local_names: frozenset = field(default_factory=lambda: _machine_names())

    def host_ok(self, host: str) -> bool:
        name = _host_name(host)
        if not name or name in self.local_names or name == "localhost" or name.endswith(".localhost"):
            return True  # no Host (HTTP/1.0 tools) cannot come from a browser
        try:
            ipaddress.ip_address(name)
            return True  # an IP literal is no DNS name a rebinding page could own
        except ValueError:
            pass
        for h in self.hosts:
            h = h.lower().rstrip(".")
            if h == "*" or h == name or (h.startswith("*.") and name.endswith(h[1:])):
                return True
        return False

    def origin_ok(self, origin: str, host: str, scheme: str) -> bool:
        if "*" in self.origins or origin in self.origins:
            return True
        return origin.lower() == f"{scheme}://{host}".lower()  # same origin as this server


def _machine_names() -> frozenset:
    try:
        n = socket.gethostname().lower()
    except OSError:
        return frozenset()
    short = n.split(".")[0]
    return frozenset({n, short, f"{short}.local"})


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def _header(scope, name: bytes) -> Optional[str]:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


class RequestLog:
    """One line per request on `out` (None: no request lines), the requests still
    open (so a shutdown that cannot wait for them still logs them), and notes
    that are written once."""

    def __init__(self, out=None):
        self.out = out
        self.open: dict = {}  # id(scope) -> (method, path, t0)
        self._once: set = set()

    def begin(self, scope, t0: float) -> None:
        self.open[id(scope)] = (scope["method"], scope["path"], t0)

    def end(self, scope, status, stats, t0: float, why: str = "", sent: Optional[int] = None) -> None:
        """`sent`: the tokens sent before the request was cut short (no stats then)."""
        if self.open.pop(id(scope), None) is None:
            return  # already logged (cut by the shutdown)
        extra = f" tokens={stats.generation_tokens} tau={stats.tau:.2f}" if stats is not None else \
            f" tokens={sent}" if sent is not None else ""
        self._line(scope["method"], scope["path"], status or 499, extra + (f" ({why})" if why else ""), t0)

    def cut_open(self, why: str) -> None:
        """Log the requests still running as 499 `why` (the process is about to exit)."""
        for key, (method, path, t0) in list(self.open.items()):
            if self.open.pop(key, None) is not None:
                self._line(method, path, 499, f" ({why})", t0)

    def once(self, key: str, msg: str) -> None:
        if key not in self._once and self.out is not None:
            self._once.add(key)
            self._write(f"mlx-dflash: {msg}\n")

    def _line(self, method, path, status, extra, t0):
        if self.out is not None:
            self._write(f"mlx-dflash: {method} {path} {status}{extra} {(time.perf_counter() - t0) * 1000:.0f} ms\n")

    def _write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):  # stderr gone (closed pipe): never fail a request for a log line
            pass


class RequestGate:
    """The ASGI middleware: reject early, add CORS headers, count the body, log."""

    def __init__(self, app, policy: AccessRules, log=True, out=None, render: Optional[Callable] = None):
        """`log`: a RequestLog, or True / False for one on `out` (default stderr) or none.
        `render(path, APIError) -> Response`: the error format of the API at that
        path (default: OpenAI's)."""
        self.app, self.policy = app, policy
        self.log = log if isinstance(log, RequestLog) else RequestLog((out or sys.stderr) if log else None)
        self.render = render or (lambda path, e: e.response())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        seen = {"status": None, "closed": False}
        origin = _header(scope, b"origin")
        cors = origin is not None and (origin in self.policy.origins or "*" in self.policy.origins)

        async def send_(msg):
            if seen["closed"]:  # we answered already (413 mid-body): drop the app's reply
                return
            if msg["type"] == "http.response.start":
                seen["status"] = msg["status"]
                if cors:
                    msg = {**msg, "headers": [*msg.get("headers", []), *_cors_headers(origin, self.policy)]}
            await send(msg)

        self.log.begin(scope, t0)
        try:
            err = self._check(scope, origin)
            if err is not None:
                # a body we will not read: close rather than read and discard it
                body = scope["method"] in ("POST", "PUT", "PATCH") or err.status == 413
                return await _reply(send_, self.render(scope["path"], err), close=body)
            if origin is not None and scope["method"] == "OPTIONS" and \
                    _header(scope, b"access-control-request-method") is not None:
                return await _preflight(send_, scope, origin, self.policy)
            await self.app(scope, self._counted(scope, receive, send_, seen), send_)
        finally:
            why = state.get(CUT_KEY) or ("client left" if SENT_KEY in state and STATS_KEY not in state else "")
            self.log.end(scope, seen["status"], state.get(STATS_KEY), t0, why, state.get(SENT_KEY))
            length = _header(scope, b"content-length")
            if length is not None and length.strip().isdigit() and int(length) >= LARGE_BODY:
                release_memory()

    def _check(self, scope, origin) -> Optional[APIError]:
        host = _header(scope, b"host") or ""
        if not self.policy.host_ok(host):
            name = _host_name(host)[:100]
            return APIError(403, f"host '{name}' is not served here; start the server with "
                                 f"--allowed-hosts {name} if you trust that name", code="host_not_allowed")
        if origin is not None and not self.policy.origin_ok(origin, host, scope.get("scheme", "http")):
            return APIError(403, f"requests from web pages at {origin[:100]} are not allowed; start the server "
                                 f"with --cors {origin[:100]} if you trust that page", code="origin_not_allowed")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if ctype != "application/json":
                return APIError(415, "send the request body as JSON with the header "
                                     "'Content-Type: application/json'", code="unsupported_media_type")
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                return APIError(400, "invalid Content-Length header")
            if int(length) > self.policy.max_body:
                return _too_large(self.policy.max_body)
        return None

    def _counted(self, scope, receive, send, seen):
        """`receive`, counting body bytes; past the limit the client gets its 413
        at once and the app sees a disconnect."""
        total = 0
        limit = self.policy.max_body

        async def receive_():
            nonlocal total
            msg = await receive()
            if msg["type"] == "http.request":
                total += len(msg.get("body", b""))
                if total > limit:
                    if seen["status"] is None:
                        await _reply(send, self.render(scope["path"], _too_large(limit)), close=True)
                    seen["closed"] = True
                    return {"type": "http.disconnect"}
            return msg

        return receive_


def release_memory() -> None:
    """Hand memory the process freed back to the system. glibc keeps freed heap
    memory for reuse, so after one huge request the server would hold its size
    for good; macOS's allocator returns large blocks by itself."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_libc = _glibc()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over {limit >> 20} MiB", code="request_too_large")


async def _reply(send, resp, close: bool = False):
    if close:  # the rest of the body is never read: the connection cannot be reused
        resp.headers["connection"] = "close"
    await resp({"type": "http"}, None, send)


def _cors_headers(origin: str, policy: AccessRules):
    allow = "*" if "*" in policy.origins else origin
    return [(b"access-control-allow-origin", allow.encode("latin-1")), (b"vary", b"Origin")]


async def _preflight(send, scope, origin: str, policy: AccessRules):
    """The answer to a CORS preflight from an allowed origin (send_ adds the origin headers)."""
    asked = _header(scope, b"access-control-request-headers") or ""
    headers = [(b"access-control-allow-methods", b"GET, POST, OPTIONS"), (b"access-control-max-age", b"600"),
               (b"content-length", b"0")]
    if asked:
        headers.append((b"access-control-allow-headers", asked.encode("latin-1")))
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def make_auth(api_key: Optional[str]) -> Callable:
    """The FastAPI dependency that checks the API key: 'Authorization: Bearer K'
    (OpenAI clients) or 'x-api-key: K' (Anthropic clients), in constant time."""
    want = api_key.encode("utf-8") if api_key is not None else None

    async def auth(request: Request):
        if want is None:
            return
        h = request.headers.get("authorization", "")
        scheme, _, token = h.partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), want):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' "
                                "or 'x-api-key: <key>')", code="invalid_api_key")

    return auth
