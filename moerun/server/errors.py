"""Errors in OpenAI's shape, {"error": {"code", "message", "type", "param"}}, with llama-server's type
names, and in Anthropic's, {"type": "error", "error": {"type", "message"}}, on its Messages API's paths
(`shape_for`); and the guard in front of every route: API key (constant-time compare) and request body
size."""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("moerun.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 501: "not_supported_error",
         503: "unavailable_error"}
# Anthropic's error types by status (its API answers 529 when overloaded; moerun's 503s keep their status)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                   529: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"  # the Messages API's paths: it and everything under it


def shape_for(path: str) -> str:
    """The error shape a path is answered in: "anthropic" on the Messages API's paths, else "openai"."""
    return "anthropic" if path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/") else "openai"


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error object for an HTTP status (also the data of its streams' `error` event)."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    """An error answered to the client; extra keys go into the error object (e.g. n_prompt_tokens)."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.param, self.extra = status, message, param, extra
        self.type = type or TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, "param": self.param,
                          **self.extra}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer to a request for `path`, in that path's error shape (shape_for)."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        body = anthropic_error(self.status, self.message) if shape_for(path) == "anthropic" else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON in the request body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    parts, param = [], None
    for e in errors[:3]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        param = param or (where if loc else None)
        parts.append(f"{where}: {e.get('msg')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more, param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, message).response(request.url.path)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response(request.url.path)


class Guard:
    """ASGI middleware: Bearer API key on every path but the open ones, and a cap on the body's size (413).

    The body is read here, up to the cap, and replayed to the app; later receive() calls go to the client's
    connection, so the app still learns of a disconnect. Bodies are JSON whatever their Content-Type says
    (as llama-server: `curl -d '{...}'` sends application/x-www-form-urlencoded)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, open_paths: frozenset[str]):
        self.app, self.max_body_bytes, self.open_paths = app, max_body_bytes, open_paths
        self._key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._key is not None and scope["path"] not in self.open_paths and not self._authorized(headers):
            await APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>'").response(scope["path"])(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(int(declared), scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending its body
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await self._too_large(None, scope, receive, send)
                return
        if body and b"json" not in headers.get(b"content-type", b""):
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer":
            token = headers.get(b"x-api-key", b"")
        return hmac.compare_digest(token.strip(), self._key)

    async def _too_large(self, size: int | None, scope: Scope, receive: Receive, send: Send) -> None:
        what = f"{size} bytes" if size is not None else "larger than that"
        err = APIError(413, f"request body too large: the limit is {self.max_body_bytes} bytes (--max-body-size); "
                            f"this one is {what}")
        await err.response(scope["path"])(scope, receive, send)
