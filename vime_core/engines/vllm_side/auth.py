"""The engine's authentication: an ASGI middleware loaded into vLLM's API server (`--middleware
...auth.EngineAuthMiddleware`). Rule: a request reaches vLLM only with `Authorization: Bearer <token>`
carrying the run's token, on every route and websockets too (vLLM's own --api-key guards only some
prefixes); anything else gets 401 before any vLLM code runs. The token comes from the process's
environment (TOKEN_ENV), compared in constant time; without it the middleware refuses to start.

Only where OPEN_HEALTH_ENV is "1" (runs through vllm-router, whose worker health checks carry no
Authorization header) GET and HEAD /health pass without it. Standard library only: it runs in vLLM."""

from __future__ import annotations

import hmac
import json
import os
from typing import Any, Awaitable, Callable

TOKEN_ENV = "VIME_ENGINE_TOKEN"
OPEN_HEALTH_ENV = "VIME_ENGINE_OPEN_HEALTH"
HEALTH_PATH = "/health"
REFUSAL = (
    "vime engine: this server needs the run's token (Authorization: Bearer <token>); see docs/gpus-and-clusters.md"
)
WEBSOCKET_POLICY_VIOLATION = 1008

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class EngineAuthMiddleware:
    """Pure ASGI middleware (vLLM adds it with `app.add_middleware(EngineAuthMiddleware)`)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(
                f"{TOKEN_ENV} is not set in the engine's environment: the server will not start "
                f"unauthenticated (vime_core/engines/server.py sets it)"
            )
        self.app = app
        self._expected = f"Bearer {token}".encode("latin-1")
        self._open_health = os.environ.get(OPEN_HEALTH_ENV) == "1"

    def authorized(self, scope: Scope) -> bool:
        """Exactly one Authorization header, equal to `Bearer <token>` (constant-time compare)."""
        values = [v for k, v in scope.get("headers") or () if k.lower() == b"authorization"]
        return len(values) == 1 and hmac.compare_digest(values[0], self._expected)

    def _open(self, scope: Scope) -> bool:
        return (
            self._open_health
            and scope["type"] == "http"
            and scope.get("method") in ("GET", "HEAD")
            and scope.get("path") == HEALTH_PATH
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._open(scope) or self.authorized(scope):
            await self.app(scope, receive, send)  # lifespan events, the open health route, or the token
            return
        if scope["type"] == "websocket":  # closed before accept: the client sees HTTP 403
            await send({"type": "websocket.close", "code": WEBSOCKET_POLICY_VIOLATION})
            return
        body = json.dumps({"error": REFUSAL}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
