"""The FastAPI app of `deltaspec serve` (`build_app`) and the process around it (`run_server`).

Owns routing (which key guards which endpoint is `auth.py`; what a web page may do, the Host check and CORS,
is `browsers.py`), request-body parsing (the body's own checks are in `body.py`, the rules types cannot say in
`checks.py`; parsing and validation run on a worker thread; bad JSON or bad field types are a 400 with one
sentence, never FastAPI's 422), turning every failure into an OpenAI-style error body without
the server's file paths (`APIError` as itself, logged with the request's id; anything unexpected is a 500
for that request only, `request_ids.py`), the throughput lines' background task while the app runs, and
the start-up summary and the shutdown line. The endpoint logic lives in `chat.py`, `completions.py`, `responses.py`
(OpenAI's Responses API), `llama.py` (llama-server's `/completion`) and `tokenizing.py` (`/tokenize`, `/detokenize`,
`/version`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import APIRouter, Depends, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deltaspec.config.engine import EngineConfig
from deltaspec.config.server import ServerConfig
from deltaspec.engine.async_engine import AsyncEngine
from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError
from deltaspec.server.auth import api_key_of, bearer_check
from deltaspec.server.body import check_content_type, parse_json, read_body
from deltaspec.server.browsers import add_browser_protections
from deltaspec.server.chat import create_chat_completion
from deltaspec.server.checks import check_fields, reject_unimplemented
from deltaspec.server.completions import create_completion
from deltaspec.server.context import ServerContext
from deltaspec.server.dialects import reject_llama_only, resolve_aliases
from deltaspec.server.errors import APIError, validation_error
from deltaspec.server.llama import LlamaCompletionRequest, create_llama_completion
from deltaspec.server.logs import configure_logging, log_stats, startup_summary
from deltaspec.server.memory import TrimAfterLargeBodies
from deltaspec.server.metrics import RequestLog, ServerMetrics
from deltaspec.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingFields
from deltaspec.server.request_ids import RequestIds, log_error
from deltaspec.server.responses import create_response
from deltaspec.server.responses_protocol import ResponsesRequest
from deltaspec.server.tokenizing import DetokenizeRequest, TokenizeRequest, detokenize, server_version, tokenize

log = logging.getLogger("deltaspec.server")

DEFAULT_MODEL_NAME = "deltaspec-default"


def served_model_name(engine: Engine, config: ServerConfig) -> str:
    """--served-model-name, else the checkpoint directory's name (or the hub id as given; SHAPE-random for
    --random-weights)."""
    if config.served_model_name:
        return config.served_model_name
    if engine.config.load.random_weights:
        return f"{engine.config.load.shape}-random"
    model = engine.config.load.model
    if model is None:
        return DEFAULT_MODEL_NAME
    return Path(model).name if Path(model).exists() else model  # a directory or a GGUF file: its name, no path


def _decode(raw: bytes, model: type[BaseModel], vocab_size: int) -> BaseModel:
    data = parse_json(raw)
    generates = issubclass(model, SamplingFields)
    if generates:
        reject_unimplemented(data)
        reject_llama_only(data)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if generates:
        body = resolve_aliases(body)
        check_fields(body, vocab_size)
    return body


async def _parse(request: Request, model: type[BaseModel], max_bytes: int, vocab_size: int) -> BaseModel:
    """The body as a `model`: Content-Type and size checked first, then parsed and validated on a worker thread (a
    request that generates also for llama-server's spellings and token ids against the model's `vocab_size`)."""
    check_content_type(request)
    raw = await read_body(request, max_bytes)
    return await asyncio.to_thread(_decode, raw, model, vocab_size)


def build_app(async_engine: AsyncEngine, server_config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app serving `async_engine` (which the caller starts and shuts down)."""
    engine = async_engine.engine
    ctx = ServerContext(
        engine=async_engine,
        config=server_config,
        model_name=served_model_name(engine, server_config),
        metrics=ServerMetrics(lambda: async_engine.usage),
        request_log=RequestLog(server_config.request_log) if server_config.request_log else None,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stats = None
        if not server_config.disable_log_stats:
            prefix_caching, interval = engine.cache.prefix is not None, server_config.log_stats_interval
            stats = asyncio.create_task(
                log_stats(ctx.metrics.tally, lambda: async_engine.usage, prefix_caching, interval)
            )
        yield
        if stats is not None:
            stats.cancel()

    app = FastAPI(title="deltaspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.ctx = ctx
    add_browser_protections(app, server_config)
    app.add_middleware(TrimAfterLargeBodies)
    app.add_middleware(RequestIds, access_log=server_config.access_log, redact=ctx.redact)  # the outermost

    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        log_error(exc.status, exc.message)
        return exc.response(ctx.redact)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        error = APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}.")
        return await api_error(request, error)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)

    operations = APIRouter(dependencies=[Depends(bearer_check(server_config.metrics_key, "metrics key"))])

    @operations.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @operations.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @operations.get("/version")
    async def version() -> Response:
        return JSONResponse(server_version())

    api = APIRouter(dependencies=[Depends(bearer_check(api_key_of(server_config), "API key"))])
    max_bytes, vocab_size = server_config.max_request_bytes, engine.model_config.vocab_size

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest, max_bytes, vocab_size)
        return await create_chat_completion(ctx, body, request)

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, max_bytes, vocab_size)
        return await create_completion(ctx, body, request)

    @api.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await _parse(request, ResponsesRequest, max_bytes, vocab_size)
        return await create_response(ctx, body, request)

    @api.post("/completion")
    async def llama_completion(request: Request) -> Response:
        body = await _parse(request, LlamaCompletionRequest, max_bytes, vocab_size)
        return await create_llama_completion(ctx, body, request)

    @api.post("/tokenize")
    async def tokenize_text(request: Request) -> Response:
        body = await _parse(request, TokenizeRequest, max_bytes, vocab_size)
        return JSONResponse(await tokenize(ctx, body))

    @api.post("/detokenize")
    async def detokenize_ids(request: Request) -> Response:
        body = await _parse(request, DetokenizeRequest, max_bytes, vocab_size)
        return JSONResponse(await detokenize(ctx, body))

    @api.get("/v1/models")
    async def models() -> Response:
        config = engine.config
        card = ModelCard(
            id=ctx.model_name,
            root=ctx.model_name,
            max_model_len=ctx.max_model_len,
            shape=config.load.shape if config.load.random_weights else None,
            speculative=config.speculation.speculative,
            draft_tokens=config.speculation.draft_tokens if config.speculation.speculative != "none" else None,
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    app.include_router(operations)
    app.include_router(api)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); a busy port is a DeltaspecError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise DeltaspecError(
            f"Cannot listen on {host}:{port} ({exc.strerror}); pick another --host or --port."
        ) from None
    sock.listen(2048)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn, whose shutdown (SIGTERM, Ctrl-C) first drains the engine: no new request is admitted, the ones in
    flight get `shutdown_timeout` seconds to finish, and the rest end with an OpenAI error (an error event and
    [DONE] on a stream, a 503 body otherwise) that their handlers send and log like any other ending."""

    def __init__(self, app: FastAPI):
        ctx = app.state.ctx
        self.async_engine, self.constraints, self.drain_s = ctx.engine, ctx.constraints, ctx.config.shutdown_timeout
        super().__init__(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=int(self.drain_s) + 10))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal starts the drain; a second Ctrl-C ends it at once (the requests in flight end with the shutdown
        error, uvicorn stops waiting for connections). A drained shutdown is a clean one, so the process then exits
        0: the signal is not raised again afterwards, as uvicorn's own handler would."""
        if self.should_exit and sig == signal.SIGINT:
            log.warning("second interrupt: ending the requests in flight now")
            self.force_exit = True
            self.async_engine.cut_drain()
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.constraints.close()  # requests waiting for a constraint's compile end now, with a 503
        drain = asyncio.create_task(self.async_engine.drain(self.drain_s))
        await super().shutdown(sockets)  # stops listening, then waits for the handlers, which the drain ends
        await drain


def make_server(app: FastAPI) -> uvicorn.Server:
    return DrainingServer(app)


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Load the model, start the engine loop, log what was built and serve until interrupted."""
    configure_logging()
    sock = bind_socket(server_config.host, server_config.port)
    async_engine = AsyncEngine(Engine(engine_config))
    async_engine.start()
    try:
        app = build_app(async_engine, server_config)
        for line in startup_summary(async_engine.engine, app.state.ctx.model_name):
            log.info(line)
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        print(f"deltaspec: serving '{app.state.ctx.model_name}' at http://{url_host}:{port}/v1", flush=True)
        make_server(app).run(sockets=[sock])
    finally:
        async_engine.shutdown()
        sock.close()
    print("deltaspec: shut down", flush=True)
