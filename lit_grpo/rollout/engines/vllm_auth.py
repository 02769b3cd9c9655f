"""The API key of a generation server, on every endpoint the trainer uses.

vLLM's ``--api-key`` (or ``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere``: the weight-transfer endpoints (``/init_weight_transfer_engine``,
``/update_weights``, ...), ``/pause``, ``/resume``, ``/sleep``, ``/collective_rpc`` and
``/reset_prefix_cache`` stay open to whoever reaches the port (vLLM's security guide says so).
:class:`KeyRequired`, an ASGI middleware that ``lit-grpo serve`` hands vLLM's server
(``--middleware lit_grpo.rollout.engines.vllm_auth.KeyRequired``), asks for the key on every path but
``/health`` (which says only whether the server is up, and which the trainer polls before it knows
anything else).

One variable serves both sides: the server reads the key from ``VLLM_API_KEY`` (``lit-grpo serve
--api-key KEY`` puts it there), the trainer sends the same variable as ``Authorization: Bearer KEY``
on every request (:mod:`lit_grpo.rollout.engines.vllm_server_api`). Without the variable the middleware
lets everything through: ``lit-grpo serve`` then listens on 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["API_KEY_VARIABLE", "OPEN_PATHS", "KeyRequired", "bearer_header"]

API_KEY_VARIABLE = "VLLM_API_KEY"  # vLLM's own variable: one export serves its server, this middleware and the trainer
OPEN_PATHS = frozenset({"/health"})  # up or not, nothing more


def bearer_header(key: str) -> dict[str, str]:
    """The header a request carries ``key`` in (vLLM's and OpenAI's)."""
    return {"Authorization": f"Bearer {key}"}


class KeyRequired:
    """Pure ASGI middleware: a request to any path but :data:`OPEN_PATHS` without
    ``Authorization: Bearer $VLLM_API_KEY`` is answered 401 and goes no further (HTTP and
    websockets alike, every method). ``key``: the key to ask for (default: the variable's value,
    read once, when vLLM's server builds its app; unset or empty: no key asked for)."""

    def __init__(self, app, key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(API_KEY_VARIABLE, "")
        self.key_digest = hashlib.sha256(key.encode()).digest() if key else None

    def allows(self, scope) -> bool:
        if self.key_digest is None or scope["type"] not in ("http", "websocket"):
            return True  # no key set; "lifespan": the server's own start and stop
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given_digest = hashlib.sha256(given.encode("latin-1")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(given_digest, self.key_digest)

    async def __call__(self, scope, receive, send) -> None:
        if self.allows(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = b'{"error": "Unauthorized: this server asks for the key in VLLM_API_KEY (Authorization: Bearer)"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
