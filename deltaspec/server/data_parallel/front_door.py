"""The front door of data-parallel serving (`build_front_door`): one OpenAI-compatible address in front of N replica
servers, each an ordinary deltaspec server. Every request is forwarded whole to the replica the `PrefixRouter`
chooses (a generating request by its prompt's prefix, anything else to the least-loaded replica), and the replica's
answer comes back unchanged: its status, headers and body, streamed as it arrives (SSE chunks pass one by one), so
errors keep the replica's one sentence. The replica does everything else a request needs (parsing, validation, the
API key), except what the door itself must: the `Host` check and CORS of the address the user opened
(`browsers.py`), request ids and the access log (`request_ids.py`), the body-size limit (it reads the body to route
it), and the API key of generating requests (their prompts are recorded for routing only once the key is right).

The door answers three things itself: `/health` (each replica's own `/health`: `ok` when all answer, `degraded`
when some do, `down` and a 503 when none does), `/metrics` (`data_parallel/metrics.py`) and a 503 of one sentence
when the chosen replica does not answer or none is up. A replica that does not answer is marked down until a health
check (every `HEALTH_INTERVAL_S`, and each `/health`) finds it answering again; a stream cut by a replica that
failed ends with an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import httpx2
from fastapi import Depends, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from deltaspec.config.server import ServerConfig
from deltaspec.server.auth import api_key_of, bearer_check
from deltaspec.server.body import parse_json, read_body
from deltaspec.server.browsers import add_browser_protections
from deltaspec.server.data_parallel.metrics import render
from deltaspec.server.data_parallel.prompt_text import GENERATING_PATHS, routing_text
from deltaspec.server.data_parallel.router import NoReplica, PrefixRouter, Prompt, RouterSettings
from deltaspec.server.errors import APIError
from deltaspec.server.request_ids import HEADER, RequestIds, current_request_id, log_error
from deltaspec.server.streaming import DONE, sse

log = logging.getLogger("deltaspec.server")

HEALTH_INTERVAL_S = 5.0
CHECK_TIMEOUT_S = 10.0
DISCONNECT_POLL_S = 0.5
# Headers that describe one connection, not the message (RFC 9110 7.6.1), and those the door's own server writes.
NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "date",
        "server",
        HEADER.decode(),
    }
)
REPLICA_HEADER = "x-deltaspec-replica"  # which replica answered, on every forwarded response


class Replicas:
    """The replicas' addresses, one HTTP client for each, and the router that chooses among them."""

    def __init__(self, urls: list[str], settings: RouterSettings, metrics_key: str | None) -> None:
        self.urls = urls
        self.router = PrefixRouter(len(urls), settings)
        timeout = httpx2.Timeout(connect=CHECK_TIMEOUT_S, read=None, write=None, pool=None)
        limits = httpx2.Limits(max_connections=None, max_keepalive_connections=64)
        self.clients = [
            httpx2.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False) for url in urls
        ]
        self.check_headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}

    async def get(self, replica: int, path: str) -> httpx2.Response | None:
        """GET `path` of a replica with the metrics key, marking it up or down by whether it answered 200."""
        try:
            response = await self.clients[replica].get(path, headers=self.check_headers, timeout=CHECK_TIMEOUT_S)
        except httpx2.HTTPError:
            response = None
        self.router.up[replica] = response is not None and response.status_code == 200
        return response if self.router.up[replica] else None

    async def health(self) -> list[dict]:
        answers = await asyncio.gather(*(self.get(i, "/health") for i in range(len(self.urls))))
        return [
            {"replica": i, "url": url, "status": "ok" if answer else "down", "in_flight": self.router.in_flight[i]}
            for i, (url, answer) in enumerate(zip(self.urls, answers))
        ]

    async def expositions(self) -> dict[int, str]:
        """Each answering replica's /metrics text."""
        answers = await asyncio.gather(*(self.get(i, "/metrics") for i in range(len(self.urls))))
        return {i: answer.text for i, answer in enumerate(answers) if answer is not None}

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()


def down_error(replica: int, url: str, exc: Exception) -> APIError:
    return APIError(
        503,
        f"Data-parallel replica {replica} at {url} is not answering ({type(exc).__name__}); this request was not "
        "served, try again.",
    )


class ForwardedResponse(StreamingResponse):
    """A replica's response passed through as it streams; closing it (finished, client gone) closes the replica's
    response, so a client that leaves frees its sequence there too, and calls `on_close` once."""

    def __init__(self, upstream: httpx2.Response, replica: int, on_close: Callable[[], None]) -> None:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in NOT_FORWARDED}
        super().__init__(
            self._relay(upstream, replica), upstream.status_code, {**headers, REPLICA_HEADER: str(replica)}
        )
        self.upstream, self.on_close = upstream, on_close

    @staticmethod
    async def _relay(upstream: httpx2.Response, replica: int) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx2.HTTPError as exc:
            log.error("request %s: replica %d failed mid-response (%s)", current_request_id(), replica, exc)
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                error = APIError(503, f"Data-parallel replica {replica} failed while answering ({type(exc).__name__}).")
                yield (sse(error.body()) + DONE).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            self.on_close()


async def _client_gone(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _send_unless_gone(client: httpx2.AsyncClient, outgoing: httpx2.Request, request: Request):
    """The replica's response to `outgoing` once it starts, or None when `request`'s client leaves first (the replica
    request is then cancelled, and its connection closed, so the replica frees the sequence)."""
    sending = asyncio.ensure_future(client.send(outgoing, stream=True))
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({sending, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return sending.result() if sending in done else None
    finally:
        watcher.cancel()
        sending.cancel()


def _routing_prompt(router: PrefixRouter, path: str, raw: bytes) -> Prompt | None:
    """A generating request's routing prompt (None for other requests); runs on a worker thread."""
    if path not in GENERATING_PATHS:
        return None
    try:
        body = parse_json(raw)
    except APIError:  # the replica refuses it, with its own sentence
        body = None
    return router.prompt(routing_text(path, body))


def router_settings(config: ServerConfig) -> RouterSettings:
    return RouterSettings(
        cache_threshold=config.router_cache_threshold,
        balance_abs_threshold=config.router_balance_abs_threshold,
        balance_rel_threshold=config.router_balance_rel_threshold,
    )


def build_front_door(urls: list[str], server_config: ServerConfig) -> FastAPI:
    """The front door over the replica servers at `urls` (base URLs, without /v1)."""
    replicas = Replicas(urls, router_settings(server_config), server_config.metrics_key)
    router = replicas.router

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def check_every_interval() -> None:
            while True:
                await asyncio.sleep(HEALTH_INTERVAL_S)
                await replicas.health()

        checks = asyncio.create_task(check_every_interval())
        yield
        checks.cancel()
        await replicas.close()

    app = FastAPI(title="deltaspec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.replicas = replicas
    add_browser_protections(app, server_config)
    app.add_middleware(RequestIds, access_log=server_config.access_log, redact=str)

    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        log_error(exc.status, exc.message)
        return exc.response()

    app.add_exception_handler(APIError, api_error)
    operations = [Depends(bearer_check(server_config.metrics_key, "metrics key"))]
    api_key = bearer_check(api_key_of(server_config), "API key")

    @app.get("/health", dependencies=operations)
    async def health() -> Response:
        states = await replicas.health()
        up = sum(state["status"] == "ok" for state in states)
        status = "ok" if up == len(states) else "degraded" if up else "down"
        return JSONResponse({"status": status, "replicas": states}, 200 if up else 503)

    @app.get("/metrics", dependencies=operations)
    async def metrics() -> Response:
        return Response(render(router, await replicas.expositions()), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(request: Request) -> Response:
        path = request.url.path
        if path in GENERATING_PATHS:
            await api_key(request)
        raw = await read_body(request, server_config.max_request_bytes)
        prompt = await asyncio.to_thread(_routing_prompt, router, path, raw)
        try:
            route = router.choose(prompt)
        except NoReplica:
            raise APIError(
                503, "No data-parallel replica is answering; the server cannot serve requests now."
            ) from None
        replica = route.replica
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
        headers[HEADER.decode()] = current_request_id()
        client = replicas.clients[replica]
        outgoing = client.build_request(request.method, path, params=request.query_params, content=raw, headers=headers)
        router.started(replica)
        try:
            upstream = await _send_unless_gone(client, outgoing, request)
        except BaseException as exc:
            router.finished(replica)
            if isinstance(exc, httpx2.HTTPError):
                router.up[replica] = False
                raise down_error(replica, urls[replica], exc) from None
            raise
        if upstream is None:
            router.finished(replica)
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        return ForwardedResponse(upstream, replica, lambda: router.finished(replica))

    return app
