"""The base of our pure ASGI middlewares for Serve's HTTP proxy: they act on HTTP requests
only, and pass everything else (lifespan, websockets) through untouched."""

from __future__ import annotations

from abc import ABC, abstractmethod

from starlette.types import ASGIApp, Receive, Scope, Send


class HTTPMiddleware(ABC):
    """Wraps ``app``; :meth:`handle` sees each HTTP request, the rest goes straight on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    @abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request through ``self.app``."""
