"""What a web page open in the user's browser can make the server do: nothing, unless the operator allows it.

A page cannot read another origin's responses, but it can send requests, and two kinds reach a server without a
key. A cross-site request (CSRF) can only be a "simple" one, whose body is `text/plain` or a form: `body.py`
refuses every POST body not declared as JSON (415), and a JSON one needs a CORS preflight this server answers only
for `--allowed-origins`. A DNS-rebinding page points a name of its own at the server's address and is then
same-origin with it: the `Host` header still carries that name, so `HostCheck` answers only Host names of the
address the server listens on (`allowed_host_names`), plus `--allowed-hosts` for a proxy's public name (403
otherwise). `/health` answers any Host: it reveals nothing, and load balancers probe it by whatever name they
use. CORS headers are sent only with `--allowed-origins` (`add_browser_protections`: Starlette's middleware with
vLLM's flags; vLLM itself allows every origin by default).
"""

from __future__ import annotations

import ipaddress

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from deltaspec.config.server import ServerConfig, flag_list
from deltaspec.server.errors import APIError, shown
from deltaspec.server.request_ids import log_error

ANY_ADDRESS = ("", "0.0.0.0", "::")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = ("/health",)


def host_name(value: str) -> str:
    """The name in a Host header or a bind address, without port, brackets or trailing dot, lowercased; an IP
    address in its canonical form (`[0:0::1]:8000` -> `::1`)."""
    text = value.strip().lower()
    if text.startswith("["):
        text = text[1 : text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    text = text.rstrip(".")
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return text


def is_loopback(name: str) -> bool:
    """Whether `name` (as `host_name` gives it) names this machine's loopback interface."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_host_names(bind_host: str, allowed_hosts: str | None) -> frozenset[str] | None:
    """The Host names the server answers, or None for any: the names of `--allowed-hosts` ('*': any) plus, for a
    loopback bind address, the loopback names; for another address, that address; for 0.0.0.0 and ::, any name
    unless `--allowed-hosts` names some (then those and the loopback names)."""
    extra = {host_name(name) for name in flag_list(allowed_hosts, "--allowed-hosts")} if allowed_hosts else set()
    bind = host_name(bind_host)
    if "*" in extra or (bind in ANY_ADDRESS and not extra):
        return None
    if bind in ANY_ADDRESS:
        own = LOOPBACK_NAMES
    elif is_loopback(bind):
        own = LOOPBACK_NAMES | {bind}
    else:
        own = frozenset({bind})
    return own | extra


def host_allowed(header: str | None, names: frozenset[str]) -> bool:
    """Whether a request with this Host header may be answered; a request without one (HTTP/1.0) may: no browser
    sends such a request."""
    return header is None or host_name(header) in names


class HostCheck:
    """ASGI middleware: a 403 of one sentence for a request whose Host the server does not answer (see the module
    docstring); `names` is `allowed_host_names`' set."""

    def __init__(self, app: ASGIApp, names: frozenset[str], bind_host: str) -> None:
        self.app, self.names, self.bind_host = app, names, bind_host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not host_allowed(header, self.names):
                error = APIError(
                    403,
                    f"This server does not answer the Host {shown(header)}, as it listens on {self.bind_host}; "
                    "to reach it by that name (through a proxy), start it with --allowed-hosts naming it.",
                    param="Host",
                )
                log_error(error.status, error.message)
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_browser_protections(app: FastAPI, config: ServerConfig) -> None:
    """CORS when `--allowed-origins` asks for it, then the Host check around it (the caller adds its outer
    middleware afterwards)."""
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=flag_list(config.allowed_origins, "--allowed-origins"),
            allow_methods=flag_list(config.allowed_methods, "--allowed-methods"),
            allow_headers=flag_list(config.allowed_headers, "--allowed-headers"),
            allow_credentials=config.allow_credentials,
        )
    names = allowed_host_names(config.host, config.allowed_hosts)
    if names is not None:
        app.add_middleware(HostCheck, names=names, bind_host=config.host)
