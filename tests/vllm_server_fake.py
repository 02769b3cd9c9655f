"""A stand-in for a vLLM server, for tests of the trainer's side of ``lit_grpo.rollout.engines.vllm_server``.

``FakeVLLMServer`` answers the few endpoints the client uses, on 127.0.0.1, from a thread of the test
(``http.server``): ``/health``, ``/v1/models``, ``/get_world_size``, ``/server_info`` and
``/inference/v1/generate``. What it answers is set by attributes, so that a test can make it slow,
silent, refusing, or wrong in one way; where it refuses as vLLM does, it gives vLLM 0.32's own answer
(seen on a real server):

- ``health``: ``"ok"``, ``"down"`` (503) or ``"silent"`` (never answers);
- ``generate``: ``"ok"`` (``n`` completions of ``COMPLETION`` with its log-probs), ``"too_long"``
  (vLLM's 400 for a prompt longer than ``max_model_len``), ``"silent"``, ``"wrong_count"`` (one
  completion too few), ``"cut_off"`` (the body ends early), ``"not_json"``, ``"wrong_logprobs"``;
- ``generate_delay``: seconds each generate waits before answering;
- ``weight_transfer``: the backend of its ``--weight-transfer-config`` (None: started without one,
  and ``/init_weight_transfer_engine`` answers vLLM's 500); ``server_info``: whether it says so at
  ``/server_info`` (False: 404, as a server without the endpoint).

- ``api_key``: the key it asks for, as ``lit-grpo serve`` with ``VLLM_API_KEY`` does, on every path but
  ``/health`` (None: none); ``authorized`` and ``refused`` count the requests it let through and refused.

``connections``: the connections it accepted; ``generate_calls``: the generate requests it got.
Run as a script (``python vllm_server_fake.py [too_long|ok ...]``) it serves until killed, one server
per word, printing their URLs on one line.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

COMPLETION = [7, 8, 9]
TOO_LONG = ("The decoder prompt (length 70) is longer than the maximum model length of 64. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens.")
NOT_CONFIGURED = ("Call to collective_rpc method failed: Worker failed with error 'Weight transfer not configured. "
                  "Please set weight_transfer_config to enable weight transfer.', please check the stack trace above "
                  "for the root cause")


class FakeVLLMServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a client opens up to 64 connections at once

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.health, self.generate, self.generate_delay = "ok", "ok", 0.0
        self.weight_transfer: str | None = "gloo"
        self.server_info = True
        self.max_model_len = 256
        self.api_key: str | None = None
        self.authorized = self.refused = 0
        self.connections = 0
        self.generate_calls = 0
        self.released = threading.Event()  # set at stop: what waits "forever" ends
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def get_request(self):
        self.connections += 1
        return super().get_request()

    def start(self) -> "FakeVLLMServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.released.set()
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connections
    server: FakeVLLMServer

    def log_message(self, *args) -> None:
        pass

    def answer(self, status: int, body, length: int | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(length if length is not None else len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def silent(self) -> None:
        self.server.released.wait()
        self.close_connection = True

    def refuses(self, path: str) -> bool:
        """Whether the request lacks the key the server asks for (then answered 401)."""
        if self.server.api_key is None or path == "/health":
            return False
        if self.headers.get("Authorization") == f"Bearer {self.server.api_key}":
            self.server.authorized += 1
            return False
        self.server.refused += 1
        self.answer(401, {"error": "Unauthorized"})
        return True

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if self.refuses(path):
            return
        if path == "/health":
            if self.server.health == "silent":
                return self.silent()
            return self.answer(200 if self.server.health == "ok" else 503, b"")
        if path == "/v1/models":
            return self.answer(200, {"data": [{"id": "tiny", "max_model_len": self.server.max_model_len}]})
        if path == "/get_world_size":
            return self.answer(200, {"world_size": 1})
        if path == "/server_info" and self.server.server_info:
            transfer = self.server.weight_transfer
            return self.answer(200, {"vllm_config": {"weight_transfer_config": transfer and {"backend": transfer}}})
        self.answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        path = urlparse(self.path).path
        if self.refuses(path):
            return
        if path == "/init_weight_transfer_engine" and self.server.weight_transfer is None:
            return self.answer(500, {"error": {"message": NOT_CONFIGURED, "type": "InternalServerError", "code": 500}})
        if path != "/inference/v1/generate":
            return self.answer(200, {"message": "ok"})
        self.server.generate_calls += 1
        time.sleep(self.server.generate_delay)
        kind, n = self.server.generate, body["sampling_params"]["n"]
        if kind == "silent":
            return self.silent()
        if kind == "too_long":
            return self.answer(400, {"error": {"message": TOO_LONG, "type": "BadRequestError", "code": 400}})
        logprobs = [{"token_id": token, "logprob": -1.0} for token in COMPLETION]
        if kind == "wrong_logprobs":
            logprobs = logprobs[:-1]
        choice = {"finish_reason": "length", "token_ids": COMPLETION, "logprobs": {"content": logprobs}}
        choices = [{**choice, "index": index} for index in range(n - (kind == "wrong_count"))]
        data = json.dumps({"choices": choices}).encode()
        if kind == "not_json":
            return self.answer(200, data[:-5])
        if kind == "cut_off":  # says it sends all, sends half, and hangs up
            self.answer(200, data[: len(data) // 2], length=len(data))
            self.close_connection = True
            return
        self.answer(200, data)


if __name__ == "__main__":
    servers = []
    for kind in sys.argv[1:]:
        server = FakeVLLMServer().start()
        if kind == "no_weight_transfer":
            server.weight_transfer = None
        else:
            server.generate = kind
        servers.append(server)
    print(" ".join(server.url for server in servers), flush=True)
    threading.Event().wait()
