"""What happens before a handler: the body limit, the API key, counting."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import ServerMetrics
from .schemas import APIError


class Gate:
    """Pure ASGI (so streaming and disconnects pass through untouched): refuses bodies over
    `limit` bytes (413, whether they announce their length or not), `/v1/` requests without
    one of the API keys (401), and counts `/v1/` responses by status."""

    def __init__(self, app: ASGIApp, limit: int, api_keys: tuple[str, ...], metrics: ServerMetrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics
        self.accepted = {f"Bearer {key}".encode("latin-1") for key in api_keys}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        counted = path.startswith("/v1/")
        headers = dict(scope.get("headers") or [])

        async def refuse(err: APIError) -> None:
            if counted:
                self.metrics.requests.labels(path, str(err.status)).inc()
            await err.response()(scope, receive, send)

        if self.accepted and counted:
            if headers.get(b"authorization", b"") not in self.accepted:
                await refuse(
                    APIError(
                        401,
                        "missing or wrong API key (send the header 'Authorization: Bearer KEY')",
                        code="invalid_api_key",
                    )
                )
                return
        too_big = APIError(
            413, f"the request body is over this server's limit of {self.limit} bytes", code="body_too_large"
        )
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await refuse(too_big)
            return
        body, more = b"", True
        while more:  # read the whole body first (it is small): a chunked body is limited too
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                await refuse(too_big)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: the client's disconnect, when it comes

        async def counting_send(msg: Message) -> None:
            if counted and msg["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(msg["status"])).inc()
            await send(msg)

        await self.app(scope, replay, counting_send)
