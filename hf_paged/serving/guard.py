"""What the server checks of a request: its API key (and so its tenant) and the size of
its body, before it reaches an endpoint, in pure ASGI middleware that hides nothing from
the app (disconnects still reach `request.is_disconnected()`, streams stay streams); and
`ServerLimits`, what one request may ask of the server.

Tenants: with API keys, each key is a tenant named by its position ("key-0", "key-1", ...;
the key itself is never stored in labels or salts). The tenant goes into
`scope["state"]["tenant"]` (FastAPI's `request.state.tenant`).
"""

from __future__ import annotations

import hmac
import json
import math
from dataclasses import dataclass

OPEN_PATHS = ("/health",)  # answered without a key (load balancers, probes)
DEFAULT_TENANT = "default"  # the tenant of every request when the server has no keys


class RequestGuard:
    """ASGI middleware: 401 without a valid key (every path but /health, and /metrics
    when `metrics_without_auth`), 413 for a body over `max_request_bytes`."""

    def __init__(self, app, api_keys: list[str], max_request_bytes: int,
                 metrics_without_auth: bool = False):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_request_bytes = max_request_bytes
        self.open_paths = OPEN_PATHS + (("/metrics",) if metrics_without_auth else ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tenant = self._tenant(scope)
        if tenant is None:
            return await _reply(send, 401, "Missing or wrong API key (Authorization: Bearer).",
                                "authentication_error", "invalid_api_key")
        scope.setdefault("state", {})["tenant"] = tenant
        declared = _content_length(scope)
        if declared is not None and declared > self.max_request_bytes:
            return await _reply(send, 413, self._too_large(declared), "invalid_request_error",
                                "request_too_large")
        # Read the body here, bounded, then replay it: a chunked body without a length is
        # held to the same limit.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_request_bytes:
                return await _reply(send, 413, self._too_large(size), "invalid_request_error",
                                    "request_too_large")
            chunks.append(body)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnects

        await self.app(scope, replay, send)

    def _tenant(self, scope) -> str | None:
        if not self.keys:
            return DEFAULT_TENANT
        if scope["path"] in self.open_paths:
            return DEFAULT_TENANT
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        for i, key in enumerate(self.keys):
            if hmac.compare_digest(token, key):
                return f"key-{i}"
        return None

    def _too_large(self, size: int) -> str:
        return (f"The request body has {size} bytes or more; this server takes at most "
                f"{self.max_request_bytes} (--max-request-bytes).")


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reply(send, status: int, message: str, kind: str, code: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class ServerLimits:
    """What one request may ask of the server (each has a `hf-paged serve` flag).

    max_waiting_sequences: sequences (prompts x n) queued and not started, past which a
        request gets 503 + Retry-After; a request with more than this alone gets 400 (0:
        every request gets 503, a server that takes none for now)
    max_request_bytes:     largest request body (413 past it)
    max_stop_strings, max_stop_chars: stop strings per request, and their total length
    request_timeout:       seconds a request may take, queued or running (None: no limit);
        a request's own `timeout` may ask for less, never more
    shutdown_grace:        seconds open requests get at shutdown before they end with an error
    """

    max_waiting_sequences: int = 512
    max_request_bytes: int = 4 * 2**20
    max_stop_strings: int = 64
    max_stop_chars: int = 8192
    request_timeout: float | None = None
    shutdown_grace: float = 10.0

    def __post_init__(self):
        """ValueError for a limit no request could meet (a server that refuses everything)."""
        for name, kind, low in (("max_waiting_sequences", int, 0), ("max_request_bytes", int, 1),
                                ("max_stop_strings", int, 0), ("max_stop_chars", int, 0),
                                ("request_timeout", float, None), ("shutdown_grace", float, 0)):
            value = getattr(self, name)
            if value is None and low is None:  # (no limit)
                continue
            number = not isinstance(value, bool) and isinstance(value, (int, float) if
                                                                  kind is float else int)
            if not (number and math.isfinite(value) and (value > 0 if low is None else
                                                         value >= low)):
                bound = "> 0" if low is None else f">= {low}"
                raise ValueError(f"ServerLimits.{name} must be a finite {kind.__name__} "
                                 f"{bound}; got {value!r}.")
