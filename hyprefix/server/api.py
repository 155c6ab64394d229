"""The FastAPI app: OpenAI routes, health, metrics, errors, API key; and ``run_server``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable
from types import FrameType
from typing import Annotated, Any

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hyprefix import __version__
from hyprefix.async_engine import AsyncEngine, EngineClosedError, EngineDeadError
from hyprefix.catalog import DEFAULT_MODEL
from hyprefix.config import EngineArgs
from hyprefix.engine import Engine
from hyprefix.server.args import ServerArgs
from hyprefix.server.backend import LocalBackend, ServingBackend
from hyprefix.server.chat_output import ChatOptions
from hyprefix.server.control import CONTROL_PATHS, add_control_routes
from hyprefix.server.limits import ServerLimits
from hyprefix.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from hyprefix.server.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from hyprefix.server.serving import as_api_error
from hyprefix.server.status import status_page

log = logging.getLogger("hyprefix.server")

_PROTECTED_PREFIXES = ("/v1/", "/reset_prefix_cache", "/tokenize", "/detokenize", *CONTROL_PATHS)
_TOKENIZE_BODY = ("vLLM's TokenizeCompletionRequest {model?, prompt, add_special_tokens, return_token_strs} or "
                  "TokenizeChatRequest {model?, messages, add_generation_prompt, continue_final_message, "
                  "add_special_tokens, chat_template, chat_template_kwargs, reasoning_effort, tools, "
                  "return_token_strs}")


def build_app(engine: Engine, model_names: list[str] | None = None, api_key: str | list[str] | None = None,
              limits: ServerLimits | None = None, cache_per_key: bool = False,
              chat: ChatOptions | None = None) -> FastAPI:
    """An app serving ``engine``. Its engine thread starts and stops with the app's
    lifespan; ``app.state.async_engine`` and ``app.state.metrics`` expose both.

    ``api_key``: one key or several; with ``cache_per_key`` every key is a tenant whose
    requests share cached blocks only with requests made with the same key (its
    ``cache_salt`` is bound to the key), so no salt a client guesses reaches another
    tenant's cache. ``chat``: tool-call and reasoning parsing (``ServerArgs.chat``)."""
    backend = LocalBackend(engine, model_names or [engine.args.model or DEFAULT_MODEL], limits, chat=chat)
    app = build_openai_app(backend, api_key, backend.limits, cache_per_key)
    app.state.async_engine, app.state.metrics = backend.async_engine, backend.metrics
    return app


def build_openai_app(backend: ServingBackend, api_key: str | list[str] | None = None,
                     limits: ServerLimits | None = None, cache_per_key: bool = False) -> FastAPI:
    """The OpenAI-compatible app over any ``ServingBackend``: one engine in this process
    (``build_app``) or engine replicas on Ray Serve (``hyprefix.replicas``)."""
    limits = limits or ServerLimits()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="hyprefix", version=__version__, lifespan=lifespan)
    app.state.backend = backend
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if cache_per_key and not keys:
        raise ValueError("--cache-per-key needs --api-key")
    if keys:
        app.add_middleware(_BearerAuth, api_keys=keys, tenants=cache_per_key)
    app.add_middleware(_BodyLimit, max_bytes=limits.max_body_bytes)  # the outermost: before any reading
    _add_error_handlers(app)
    protected, generate = _documented_errors(bool(keys), limits.max_body_bytes)

    _add_open_routes(app, backend, key_required=bool(keys))
    @app.get("/v1/models", responses=protected)
    async def models() -> dict[str, Any]:
        # root is the name, not the model's path: clients need not know the server's directories
        cards = [ModelCard(id=name, root=name, max_model_len=backend.max_model_len) for name in backend.model_names]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model_id:path}", responses={**protected, 404: generate[404], "default": generate["default"]})
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in backend.model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", type="not_found_error", param="model",
                           code="model_not_found")
        return ModelCard(id=model_id, root=model_id, max_model_len=backend.max_model_len).model_dump()

    @app.post("/reset_prefix_cache", responses=protected)
    async def reset_prefix_cache() -> dict[str, int]:
        return {"dropped_blocks": await backend.reset_prefix_cache()}

    @app.post("/v1/completions", responses=generate)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, backend.completions(body, _tenant(request)))

    @app.post("/v1/chat/completions", responses=generate)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, backend.chat(body, _tenant(request)))

    tokenize_errors = {code: generate[code] for code in (400, *protected, 404, 413, "default")}

    @app.post("/tokenize", responses=tokenize_errors)
    async def tokenize(body: Annotated[dict[str, Any], Body(description=_TOKENIZE_BODY)]) -> TokenizeResponse:
        # the form by its prompt field, validated as the other bodies (unknown fields are 400s)
        form = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            req = form.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc.errors()) from None
        return await backend.tokenize(req)

    @app.post("/detokenize", responses=tokenize_errors)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await backend.detokenize(body)

    add_control_routes(app, backend, {code: generate[code] for code in (400, *protected, "default")})

    return app


def _add_open_routes(app: FastAPI, backend: ServingBackend, key_required: bool) -> None:
    """The routes that need no API key: health, version, metrics, the status page and its data."""

    @app.get("/health")
    async def health() -> Response:
        status = await backend.health()
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await backend.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(status_page())

    @app.get("/status")
    async def status() -> dict[str, Any]:
        """The status page's data: engine counters and pools, configuration, last requests."""
        return {**await backend.status(), "api_key_required": key_required, "version": __version__}


async def _respond(request: Request, work: Awaitable[Any]) -> Response:
    """Run ``work`` (a response model or an SSE event iterator) and answer with it; if
    the client disconnects first, cancel it, which aborts its engine requests."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    result = task.result()
    # X-Request-Id: the client's, echoed (as vLLM's --enable-request-id-headers), else the response's id
    request_id = request.headers.get("x-request-id")
    if isinstance(result, dict):
        return JSONResponse(result, headers={"X-Request-Id": request_id or str(result.get("id", ""))})
    if hasattr(result, "model_dump"):
        return JSONResponse(result.model_dump(), headers={"X-Request-Id": request_id or getattr(result, "id", "")})
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if request_id:
        headers["X-Request-Id"] = request_id
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _documented_errors(with_key: bool, max_body_bytes: int) -> tuple[dict[int | str, Any], dict[int | str, Any]]:
    """OpenAPI ``responses`` of the protected routes and of the generation routes. Every
    error has the ``ErrorResponse`` shape; declaring ``default`` also keeps FastAPI from
    documenting its 422, which this server never sends (invalid bodies get a 400)."""
    def error(description: str) -> dict[str, Any]:
        return {"model": ErrorResponse, "description": description}

    protected: dict[int | str, Any] = {}
    if with_key:
        protected[401] = error("Missing or wrong API key (code `invalid_api_key`)")
    generate = {
        400: error("Invalid value, type or JSON, or a prompt over the context (code `context_length_exceeded`)"),
        **protected,
        404: error("Unknown model (code `model_not_found`)"),
        413: error(f"Request body over {max_body_bytes} bytes (code `request_too_large`)"),
        "default": error("Any other error (405, 500, 503)"),
    }
    return protected, generate


class _BodyLimit:
    """Answers 413 to a request whose body is over ``max_bytes``: at once when its
    Content-Length says so, else as soon as the bytes received (chunked) pass it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"The request body is larger than the limit of {self.max_bytes} bytes."
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await _error_response(APIError(413, too_large, code="request_too_large"))(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI re-raises an HTTPException met while reading the body; the handler answers it
                raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, receive_within_limit, send)


def _tenant(request: Request) -> str | None:
    return request.scope.get("state", {}).get("tenant")


class _BearerAuth:
    """Requires ``Authorization: Bearer <key>`` on the OpenAI routes and cache control.
    With ``tenants``, the request's scope state gets ``tenant``: a digest of its key."""

    def __init__(self, app: ASGIApp, api_keys: list[str], tenants: bool = False) -> None:
        self.app = app
        self.expected = [key.encode() for key in api_keys]
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            token = token.strip()
            # compare with every key (constant time each), so the time does not tell which matched
            matched = [key for key in self.expected if hmac.compare_digest(token, key)]
            if scheme.lower() != b"bearer" or not matched:
                error = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                 code="invalid_api_key")
                await _error_response(error)(scope, receive, send)
                return
            if self.tenants:
                scope.setdefault("state", {})["tenant"] = hashlib.sha256(matched[0]).hexdigest()[:32]
        await self.app(scope, receive, send)


def _error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    # A message may quote the client's text: escape what UTF-8 cannot carry (lone surrogates).
    error.message = error.message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc.errors()))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Client errors are APIError or pydantic's; anything else is a bug of ours, not a 400.
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error_response(APIError(500, "internal server error", type="internal_server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, code=code))

    @app.exception_handler(EngineClosedError)
    @app.exception_handler(EngineDeadError)
    async def engine_down(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(as_api_error(exc))


def _validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 for pydantic's errors: the first offending field is the ``param``."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"The request body is not valid JSON: {detail}")
    loc = [str(part) for part in first["loc"] if part != "body"]
    if not loc:
        return APIError(400, "The request body must be a JSON object (sent as Content-Type: application/json).")
    messages = []
    for error in errors[:3]:
        path = ".".join(str(part) for part in error["loc"] if part != "body")
        if error["type"] == "extra_forbidden":
            messages.append(f"{path} is not supported by this server")
        else:
            messages.append(f"{path}: {error['msg']}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return APIError(400, "; ".join(messages) + more, param=loc[0])


def _not_status_polls(record: logging.LogRecord) -> bool:
    """The access log without the status page's polls (one ``GET /status`` a second per open page)."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) >= 3 and args[1] == "GET" and args[2] == "/status")


class _Server(uvicorn.Server):
    """uvicorn's server, whose first SIGINT/SIGTERM also aborts the requests in flight,
    so open streams end at once and the graceful shutdown does not wait on them."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.async_engine.begin_shutdown()
        super().handle_exit(sig, frame)


def run_server(args: EngineArgs, server: ServerArgs | None = None, log_level: str = "info") -> None:
    """Load the model, then serve until SIGINT/SIGTERM (blocking)."""
    server = server or ServerArgs()
    engine = Engine(args)
    engine.warmup()
    app = build_app(engine, server.model_names, server.api_keys, server.limits, server.cache_per_key, server.chat)
    names = ", ".join(server.model_names or [args.model or DEFAULT_MODEL])
    log.info("serving %s on http://%s:%d (API key %s)", names, server.host, server.port,
             "required" if server.api_key else "off")
    config = uvicorn.Config(app, host=server.host, port=server.port, access_log=server.access_log,
                            log_level=log_level.lower(), timeout_graceful_shutdown=10)
    logging.getLogger("uvicorn.access").addFilter(_not_status_polls)  # after Config set uvicorn's logging up
    _Server(config, app.state.async_engine).run()
