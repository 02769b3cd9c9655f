"""One vLLM server's HTTP API as the ``vllm_server`` engine uses it, and every server as one receiver of weights.

:class:`VLLMServer` makes the requests (``requests``, one pooled session per server, the API key of
``VLLM_API_KEY`` on each) and names the server in every failure: a server that does not answer is
:class:`ServerUnavailable` (retried by the callers, with tenacity), one that refuses a request a
:class:`~lit_grpo.errors.DataError` or, without the right key, a :class:`~lit_grpo.errors.ConfigError`.
:class:`ServerFleet` makes each call of vLLM's weight-transfer protocol on every server at once. The
engine that uses both is :mod:`lit_grpo.rollout.engines.vllm_server`.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any
from urllib.parse import urlparse

from lit_grpo.errors import ConfigError, DataError
from lit_grpo.redaction import redact_text  # a URL as printed: its credentials redacted
from lit_grpo.rollout.engines.server_lost import GenerationServerLost
from lit_grpo.rollout.engines.vllm_auth import API_KEY_VARIABLE, bearer_header

__all__ = [
    "CONNECT_TIMEOUT",
    "HEALTH_TIMEOUT",
    "MAX_CONCURRENT_REQUESTS",
    "ServerFleet",
    "ServerUnavailable",
    "VLLMServer",
    "failure_reason",
    "in_background",
]

# At most this many requests in flight from one trainer process (vLLM batches them on its side); the
# connection pool of each server holds as many.
MAX_CONCURRENT_REQUESTS = 64
CONNECT_TIMEOUT = 10.0  # seconds to open a connection; a server that does not accept it is retried
HEALTH_TIMEOUT = 5.0  # seconds for an answer to /health
GENERATE = "/inference/v1/generate"


class ServerUnavailable(Exception):
    """A request a server did not answer (refused, reset, cut off, a 5xx); worth retrying for a while."""


def in_background(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """``function(*args, **kwargs)`` in a daemon thread of its own: a request to a server that hangs
    (a generation has no read timeout) never holds up the trainer's exit."""
    # by hand: ThreadPoolExecutor's workers are not daemons (the interpreter joins them at exit)
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(function(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - the caller gets it from the future
                future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="vllm-server-request").start()
    return future


class VLLMServer:
    """One vLLM server: its URL, and requests to its HTTP API that name it when they fail."""

    def __init__(self, url: str, timeout: float) -> None:
        import requests
        from requests.adapters import HTTPAdapter

        parsed = urlparse(url if "://" in url else f"http://{url}")
        if not parsed.hostname or not parsed.port:
            raise ConfigError(f"model.vllm_server_urls: {url!r} is not a server address like http://HOST:PORT")
        self.url = f"{parsed.scheme}://{parsed.netloc}{parsed.path}".rstrip("/")
        self.host = parsed.hostname
        self.timeout = timeout
        self.session = requests.Session()
        if key := os.environ.get(API_KEY_VARIABLE):  # on every request (lit-grpo serve asks for it on every endpoint)
            self.session.headers.update(bearer_header(key))
        # one connection per request in flight (requests' default pool keeps 10, and drops the rest),
        # and a few for what goes beside them: the health checks while they run, a weight push's calls
        adapter = HTTPAdapter(pool_maxsize=MAX_CONCURRENT_REQUESTS + 8)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def request(self, method: str, path: str, timeout: Any = None, **kwargs: Any) -> Any:
        """The JSON answer of ``method path``. :class:`ServerUnavailable` when the server does not
        answer (refused, reset, an answer cut off, a 5xx); a :class:`~lit_grpo.errors.DataError`
        naming the server for a request it refuses (4xx); ``requests``' ``ReadTimeout`` after
        ``timeout`` seconds (default ``model.vllm_server_timeout``; ``(connect, None)``: no read
        timeout)."""
        import requests

        try:
            response = self.session.request(method, self.url + path, timeout=timeout or self.timeout, **kwargs)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as error:  # a connect timeout too
            raise ServerUnavailable(f"{type(error).__name__}: {failure_reason(error)}") from error
        if response.status_code >= 500:
            raise ServerUnavailable(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code == 401:
            given = "a wrong key" if API_KEY_VARIABLE in os.environ else "no key"
            raise ConfigError(f"the vLLM server at {self.url} refused {path}: HTTP 401 Unauthorized ({given} in "
                              f"{API_KEY_VARIABLE}): export {API_KEY_VARIABLE} with the server's key where the trainer runs")
        if response.status_code >= 400:
            raise DataError(f"the vLLM server at {self.url} refused {path}: HTTP {response.status_code} {response.text[:500]}")
        return response.json() if response.content else None

    def wait_until_up(self) -> None:
        """Return once the server answers ``/health`` (asked every second); a one-line error naming
        it after the timeout."""
        from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

        # any failure is retried: refused, a timeout, an answer that is not vLLM's
        retrying = Retrying(retry=retry_if_exception_type(Exception), stop=stop_after_delay(self.timeout),
                            wait=wait_fixed(1.0))
        try:
            retrying(self.request, "GET", "/health", timeout=HEALTH_TIMEOUT)
        except RetryError as failed:
            error = failed.last_attempt.exception()
            known = isinstance(error, (ServerUnavailable, OSError))
            reason = str(error) if known else f"{type(error).__name__}: {error}"
            raise ConfigError(
                f"model.vllm_server_urls: no vLLM server answers at {self.url} ({reason}; waited "
                f"{self.timeout:g} s, model.vllm_server_timeout): start one there (lit-grpo serve MODEL --port "
                f"{urlparse(self.url).port}) or fix the URL") from None

    def answers(self) -> bool:
        """Whether the server answers ``/health`` now."""
        return self.silence() is None

    def silence(self) -> str | None:
        """Why the server does not answer ``/health`` now (None: it does)."""
        try:
            self.request("GET", "/health", timeout=min(HEALTH_TIMEOUT, self.timeout))
            return None
        except Exception as error:  # noqa: BLE001 - refused, reset, timed out, an error status
            return str(error) if isinstance(error, ServerUnavailable) else f"{type(error).__name__}: {failure_reason(error)}"

    def max_model_len(self) -> int:
        return int(self.request("GET", "/v1/models")["data"][0]["max_model_len"])

    def world_size(self) -> int:
        """The server's workers (tensor x pipeline x data parallel): each joins the weight transfer."""
        return int(self.request("GET", "/get_world_size")["world_size"])

    def weight_transfer_backend(self) -> str | None:
        """The backend of the server's ``--weight-transfer-config`` (None: started without one, and
        it refuses every weight transfer); ``"unknown"`` where its configuration cannot be read."""
        try:
            info = self.request("GET", "/server_info", params={"config_format": "json"})
            config = info["vllm_config"]["weight_transfer_config"]
        except (DataError, KeyError, TypeError, AttributeError):  # no such endpoint, or another layout
            return "unknown"
        return None if config is None else str(config.get("backend"))

    def generate(self, body: dict, abandoned: threading.Event, say: Callable[[VLLMServer, str], None]) -> dict:
        """The server's answer to one sampling request. No read timeout: a long generation is not a
        lost server (its ``/health`` is watched meanwhile, :meth:`VLLMServerEngine.sample`). A
        request the server does not answer is retried with exponential backoff (``say``: told the
        first failure) until ``abandoned`` is set or the timeout has passed since the first failure;
        then :class:`GenerationServerLost`."""
        from tenacity import Retrying, retry_if_exception_type, wait_exponential

        failing_since: list[float] = []

        def given_up(state) -> bool:
            failing_since[:] = failing_since or [time.monotonic()]
            return abandoned.is_set() or time.monotonic() - failing_since[0] >= self.timeout

        def tell_once(state) -> None:
            if state.attempt_number == 1:
                say(self, f"the vLLM server at {redact_text(self.url)} is not answering ({state.outcome.exception()}): "
                    f"waiting up to {self.timeout:g} s for it (model.vllm_server_timeout), then a checkpoint and a stop")

        retrying = Retrying(retry=retry_if_exception_type(ServerUnavailable), stop=given_up, reraise=True,
                            wait=wait_exponential(multiplier=0.5, max=5.0), before_sleep=tell_once)
        try:
            return retrying(self.request, "POST", GENERATE, json=body, timeout=(CONNECT_TIMEOUT, None))
        except ServerUnavailable as error:
            raise GenerationServerLost(f"the vLLM server at {self.url} has not answered for {self.timeout:g} s "
                                       f"(model.vllm_server_timeout): {error}") from error


class ServerFleet:
    """Every server of the run as one receiver of weights: vLLM's ``VLLMWeightSyncClient`` protocol,
    each call made on all servers at once (their workers receive the same broadcast, so they must be
    in it together). Server j's workers take the ranks after those of the servers before it.
    ``version``: the label of the update being sent (the policy's version)."""

    def __init__(self, servers: list[VLLMServer], world_sizes: list[int]) -> None:
        self.servers, self.world_sizes = servers, world_sizes
        self.version: str | None = None

    def _on_every_server(self, path: str, bodies: list[Any] | None = None, **kwargs: Any) -> None:
        bodies = bodies if bodies is not None else [None] * len(self.servers)
        calls = [in_background(server.request, "POST", path, json=body, **kwargs)
                 for server, body in zip(self.servers, bodies)]
        for call in calls:
            call.result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offsets = [init_info["rank_offset"] + sum(self.world_sizes[:index]) for index in range(len(self.servers))]
        self._on_every_server("/init_weight_transfer_engine",
                              [{"init_info": {**init_info, "rank_offset": offset}} for offset in offsets])

    def start_weight_update(self) -> None:
        self._on_every_server("/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._on_every_server("/update_weights", [{"update_info": update_info}] * len(self.servers))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._on_every_server("/finish_weight_update", [{"weight_version": weight_version or self.version}] * len(self.servers))

    def pause(self) -> None:
        """No new sampling until :meth:`resume`; what is running finishes first."""
        self._on_every_server("/pause", params={"mode": "wait"})

    def resume(self) -> None:
        self._on_every_server("/reset_prefix_cache")  # its blocks hold keys and values of the old weights
        self._on_every_server("/resume")


def failure_reason(error: BaseException) -> str:
    """Why a request failed, in a few words (``[Errno 111] Connection refused``, ``timed out``)."""
    text = " ".join(str(error).split())
    errno = re.search(r"\[Errno -?\d+\] [^'\")(]+", text)
    if errno:
        return errno.group(0).strip()
    return "timed out" if "timed out" in text.lower() else text[:300]
