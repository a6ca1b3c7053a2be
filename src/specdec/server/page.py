"""The server's own web page: a chat that shows each token by who proposed it (`/`), and its
metrics as tables (`/stats`). Plain HTML, CSS and JavaScript shipped in the package (`page/`),
served as they are: no build step, nothing fetched from elsewhere."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

FILES = {  # what the page is made of, and how each is served
    "index.html": "text/html; charset=utf-8",
    "stats.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "stats.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


def _file(name: str) -> Response:
    data = resources.files(__package__).joinpath("page", name).read_bytes()
    return Response(data, media_type=FILES[name], headers={"Cache-Control": "no-cache"})


def add_routes(app: FastAPI) -> None:
    """`/` the chat, `/stats` the metrics, `/page/NAME` their scripts and style (open: the page
    asks for an API key where the server has keys, and sends it with each `/v1/` request)."""

    async def index() -> Response:
        return _file("index.html")

    async def stats() -> Response:
        return _file("stats.html")

    async def asset(name: str) -> Response:
        if name not in FILES or name.endswith(".html"):
            return Response("not found", status_code=404, media_type="text/plain")
        return _file(name)

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/stats", stats, methods=["GET"], include_in_schema=False)
    app.add_api_route("/page/{name}", asset, methods=["GET"], include_in_schema=False)
