"""Which key guards which endpoints, as in vLLM: `--api-key` (else $DELTASPEC_API_KEY) guards the OpenAI API
under /v1; /health and /metrics stay open (load balancers and Prometheus scrapers send no key) unless
`--metrics-key` is given, which then guards those two.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable, Callable

from starlette.requests import Request

from deltaspec.config.server import ServerConfig
from deltaspec.server.errors import APIError

API_KEY_ENV = "DELTASPEC_API_KEY"


def api_key_of(config: ServerConfig) -> str | None:
    """--api-key, else $DELTASPEC_API_KEY; None (no key asked for) when neither is set."""
    return config.api_key or os.environ.get(API_KEY_ENV) or None


def bearer_check(key: str | None, name: str) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: 401 unless the request carries `Authorization: Bearer <key>` (a no-op without a key);
    `name` says which key it is in the error message."""

    async def check(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(
                401, f"The {name} is missing or wrong; send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )

    return check
