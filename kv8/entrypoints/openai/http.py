"""HTTP pieces both OpenAI endpoints share (``kv8 serve``'s app and the data-parallel ingress): the bounded JSON
body reader (every failure an OpenAI error with its status), the API-key check, OpenAI-shaped error handlers, the
``/v1/models`` answer and the SSE response whose close hook always runs.

Bodies are read by hand rather than by FastAPI so that every failure has OpenAI's error shape and a precise
status: 415 for a body that is not ``application/json`` (a browser page can POST text/plain or a form to a server
on 127.0.0.1 without a CORS preflight, but not JSON), 413 over the byte limit, 408 for a body that does not arrive
in time, 400 for invalid UTF-8, malformed JSON (NaN and Infinity included), a non-object body or a lone UTF-16
surrogate anywhere in it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kv8.entrypoints.openai.protocol import APIError, lone_surrogate_path
from kv8.entrypoints.openai.request_run import ClientDisconnected, Stream, log_failure


class SSEResponse(StreamingResponse):
    """A streaming response whose ``on_close`` runs however the response ends (finished, client gone,
    cancelled before the first chunk)."""

    def __init__(self, stream: Stream) -> None:
        super().__init__(stream.chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = stream.close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The raw body, at most ``limit`` bytes (413 beyond), all of it within ``timeout`` seconds (408 otherwise: a
    Content-Length larger than what arrives must not hold the connection forever). A client that goes away
    meanwhile raises :class:`ClientDisconnected` ("upload")."""
    body = bytearray()
    chunks = request.stream().__aiter__()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return bytes(body)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s (--request-body-timeout): "
                                f"{len(body)} bytes received" + (f" of the {request.headers['content-length']} "
                                "announced by Content-Length" if "content-length" in request.headers else ""),
                           code="request_timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ClientDisconnected("upload", f"{len(body)} bytes of the body received") from None
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body has more than {limit} bytes, over the limit of {limit} bytes")


async def read_json_body(request: Request, limit: int, timeout: float = 60.0) -> dict[str, Any]:
    """The request's JSON object (see the module docstring for what is refused, and with which status)."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type {ctype or '(none)'!r} is not supported; send the request body as "
                            "application/json")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {int(length)} bytes, over the limit of {limit} bytes")
    body = await _read_body(request, limit, timeout)
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})") from e
    try:
        obj = json.loads(text, parse_constant=_json_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(obj).__name__}")
    bad = lone_surrogate_path(obj)
    if bad is not None:
        raise APIError(400, f"the request holds a lone UTF-16 surrogate escape (in {bad}), which is not a "
                            "character; send text as valid Unicode", param=bad or None)
    return obj


async def wait_disconnect(request: Request) -> None:
    """Returns once the client of ``request`` went away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def check_api_key(request: Request, api_key: str | None) -> None:
    """``APIError`` 401 unless the request carries ``Authorization: Bearer <api_key>`` (nothing to check without a
    key); compared in constant time."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect or missing API key; send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


def models_response(served_model_name: str, max_model_len: int) -> JSONResponse:
    """``GET /v1/models``: the one model an endpoint serves, in OpenAI's list shape."""
    return JSONResponse({"object": "list", "data": [{
        "id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "kv8",
        "max_model_len": max_model_len}]})


def install_error_handlers(app: FastAPI, on_rejected: Callable[[int], None],
                           on_disconnect: Callable[[Request, ClientDisconnected], None]) -> Callable[[APIError],
                                                                                                     JSONResponse]:
    """OpenAI-shaped errors for ``app``: an :class:`APIError` and starlette's own (404/405 naming the route) answer
    with their status (``on_rejected(status)`` counts them; a 5xx is logged in one line; a 401 carries
    ``WWW-Authenticate``; an error of a request that has an id carries ``X-Request-Id``); a client that went
    away gets 499 after ``on_disconnect``. Returns the function that turns an ``APIError`` into that response."""
    def error_response(e: APIError) -> JSONResponse:
        on_rejected(e.status)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        return JSONResponse(e.body(), status_code=e.status, headers={**headers, **e.response_headers()})

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        log_failure(request.url.path, e)   # a 5xx's one log line (a stream logs the error it ends with itself)
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(APIError(e.status_code, msg))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected) -> Response:
        on_disconnect(request, e)
        return Response(status_code=499)

    return error_response
