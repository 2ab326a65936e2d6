"""The web page: GET / is moerun/server/webui/index.html, GET /webui/NAME the other files of that folder (its
scripts and style sheet). Hand-written files, shipped in the package and read once at start; nothing is built
at install time and nothing is fetched from elsewhere (the Content-Security-Policy allows this server alone).
The page and its files are answered without the API key (`open_paths`); the APIs it calls still need it.
Off with --no-webui (ServerConfig.webui): then none of these routes exist.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import Response

from moerun.server.errors import APIError

if TYPE_CHECKING:
    from moerun.config import ServerConfig
    from moerun.server.state import Server

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
CSP = ("default-src 'self'; img-src 'self' data:; connect-src 'self'; style-src 'self'; script-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def files() -> dict[str, tuple[bytes, str]]:
    """The page's files: name -> (bytes, content type)."""
    folder = resources.files("moerun.server") / "webui"
    out = {}
    for f in folder.iterdir():
        suffix = "." + f.name.rpartition(".")[2]
        if f.is_file() and suffix in TYPES:
            out[f.name] = (f.read_bytes(), TYPES[suffix])
    return out


def open_paths(cfg: ServerConfig) -> frozenset[str]:
    """The paths answered without the API key: the page and its files (none with --no-webui)."""
    if not cfg.webui:
        return frozenset()
    return frozenset({"/", *(f"/webui/{name}" for name in files())})


def add_routes(app: FastAPI, server: Server) -> None:
    if not server.cfg.webui:
        return
    page = files()

    def answer(name: str) -> Response:
        if name not in page:
            raise APIError(404, f"no file /webui/{name}")
        body, media_type = page[name]
        return Response(body, media_type=media_type, headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def index():
        return answer("index.html")

    @app.get("/webui/{name}", include_in_schema=False)
    async def static(name: str):
        return answer(name)
