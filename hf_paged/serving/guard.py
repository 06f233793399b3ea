"""What the server checks before a request reaches an endpoint: its API key (and so its
tenant) and the size of its body. Pure ASGI middleware, so it hides nothing from the app:
disconnects still reach `request.is_disconnected()`, streams stay streams.

Tenants: with API keys, each key is a tenant named by its position ("key-0", "key-1", ...;
the key itself is never stored in labels or salts). The tenant goes into
`scope["state"]["tenant"]` (FastAPI's `request.state.tenant`).
"""

from __future__ import annotations

import hmac
import json

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
