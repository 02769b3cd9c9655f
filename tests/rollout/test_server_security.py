"""Issue 50.1: who may talk to a generation server (``lit-grpo serve``, lit-grpo's key middleware, the
trainer's requests), without vLLM: the command ``lit-grpo serve`` builds, the middleware run as an ASGI
app in this process, the trainer's client against the stand-in server (tests/vllm_server_fake.py).
What the real server mounts, and the weight-transfer rendezvous, are tested with vLLM in
tests/rollout/test_vllm_server.py."""

from __future__ import annotations

import asyncio
import re

import pytest

from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines.vllm_auth import API_KEY_VARIABLE, KeyRequired
from lit_grpo.rollout.engines.vllm_serve import KEY_MIDDLEWARE, server_command, shown_command

KEY = "s3cret-key-of-the-test"


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_serve_listens_on_loopback_unless_told_and_elsewhere_only_with_a_key():
    command, environ = server_command(["MODEL"], on_cpu=True, environ={})
    assert option(command, "--host") == "127.0.0.1" and option(command, "--middleware") == KEY_MIDDLEWARE
    assert API_KEY_VARIABLE not in environ  # loopback: no key asked for

    with pytest.raises(ConfigError) as refused:
        server_command(["MODEL", "--host", "0.0.0.0"], on_cpu=True, environ={})
    said = str(refused.value)
    assert "\n" not in said and said.startswith("lit-grpo serve --host 0.0.0.0: without an API key")
    assert f"export {API_KEY_VARIABLE}=" in said and f"the same {API_KEY_VARIABLE} where the trainer runs" in said
    with pytest.raises(ConfigError, match="--host 10.1.2.3"):
        server_command(["MODEL", "--host=10.1.2.3"], on_cpu=False, environ={API_KEY_VARIABLE: ""})

    # with a key (the variable, or --api-key, moved into it: off the command line every user can read)
    command, environ = server_command(["MODEL", "--host", "0.0.0.0"], on_cpu=True, environ={API_KEY_VARIABLE: KEY})
    assert option(command, "--host") == "0.0.0.0" and environ[API_KEY_VARIABLE] == KEY
    command, environ = server_command(["MODEL", "--host", "::", "--api-key", KEY, "--port", "8000"], on_cpu=True, environ={})
    assert KEY not in " ".join(command) and "--api-key" not in command and environ[API_KEY_VARIABLE] == KEY
    assert command[-4:] == ["--host", "::", "--port", "8000"]
    for loopback in ("localhost", "::1", "127.0.0.2"):
        assert option(server_command(["MODEL", "--host", loopback], on_cpu=True, environ={})[0], "--host") == loopback
    with pytest.raises(ConfigError, match="lit-grpo serve --api-key: give one key"):
        server_command(["MODEL", "--api-key", "a", "--api-key=b"], on_cpu=True, environ={})


def test_serve_reads_the_last_host_as_vllm_does_and_refuses_abbreviations_vllm_would_expand():
    """vLLM's parser takes the last of a repeated option and any unambiguous prefix of a name (allow_abbrev):
    lit-grpo reads the options as vLLM will, or refuses what it cannot see, naming the full name."""
    with pytest.raises(ConfigError, match="^lit-grpo serve --host 0.0.0.0: without an API key"):
        server_command(["MODEL", "--host", "127.0.0.1", "--host", "0.0.0.0"], on_cpu=True, environ={})
    command, _ = server_command(["MODEL", "--host", "0.0.0.0", "--host=::1"], on_cpu=True, environ={})
    assert "--middleware" in command  # loopback at last: no key asked for
    for abbreviation, full in (("--hos", "--host"), ("--api-k", "--api-key"), ("--mid", "--middleware"),
                               ("--ud", "--uds"), ("--por", "--port")):
        for words in ([abbreviation, "0.0.0.0"], [f"{abbreviation}=0.0.0.0"]):
            with pytest.raises(ConfigError) as refused:
                server_command(["MODEL", *words], on_cpu=True, environ={API_KEY_VARIABLE: KEY})
            said = str(refused.value)
            assert said.startswith(f"lit-grpo serve {abbreviation}: ") and f"give the full name {full}" in said
            assert "\n" not in said and "0.0.0.0" not in said  # the value (a key, perhaps) is not repeated


def test_serve_prints_no_secret_of_its_command_line():
    shown = shown_command(["-m", "vllm", "--model", "M", "--api-key", KEY, "--hf-token=hf_abcdef", "--ssl-keyfile", "k.pem",
                           "--served-model-name", "https://user:pa55@example.com/path", "--port", "8000"])
    assert KEY not in shown and "hf_abcdef" not in shown and "pa55" not in shown and "user:" not in shown
    assert shown == ("-m vllm --model M --api-key *** --hf-token=*** --ssl-keyfile *** --served-model-name "
                     "https://***@example.com/path --port 8000")


def asgi_call(app, path: str, method: str = "POST", headers: dict[str, str] | None = None, kind: str = "http") -> int:
    """The status ``app`` answers a request with (a websocket refused: 403, as uvicorn answers a close before accept)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": kind, "method": method, "path": path, "root_path": "",
             "headers": [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]}
    asyncio.run(app(scope, receive, send))
    first = sent[0]
    return first["status"] if first["type"] == "http.response.start" else 403 if first["type"] == "websocket.close" else 200


async def endpoint(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


# every endpoint the trainer uses, and vLLM's others that change the server (vLLM's key guards none but /v1, /inference)
GUARDED = ["/inference/v1/generate", "/v1/models", "/get_world_size", "/server_info", "/init_weight_transfer_engine",
           "/start_weight_update", "/update_weights", "/finish_weight_update", "/shutdown_weight_transfer_engine", "/pause",
           "/resume", "/reset_prefix_cache", "/sleep", "/wake_up", "/collective_rpc", "/version", "/metrics", "/invocations"]


def test_the_key_middleware_guards_every_endpoint_but_health():
    guarded = KeyRequired(endpoint, key=KEY)
    for path in GUARDED:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            assert asgi_call(guarded, path, headers=headers) == 401, (path, headers)
        assert asgi_call(guarded, path, headers={"Authorization": f"Bearer {KEY}"}) == 200, path
    assert asgi_call(guarded, "/pause", method="OPTIONS") == 401  # every method
    assert asgi_call(guarded, "/v1/realtime", kind="websocket") == 403
    assert asgi_call(guarded, "/health", method="GET") == 200  # up or not, nothing more
    assert asgi_call(KeyRequired(endpoint, key=""), "/update_weights") == 200  # no key set: lit-grpo serve is on loopback


def test_the_trainer_sends_the_key_on_every_request_and_a_refusal_names_the_variable(monkeypatch):
    from vllm_server_fake import FakeVLLMServer

    from lit_grpo.rollout.engines.vllm_server_api import ServerFleet, VLLMServer

    fake = FakeVLLMServer().start()
    try:
        fake.api_key = KEY
        monkeypatch.setenv(API_KEY_VARIABLE, KEY)
        server = VLLMServer(fake.url, timeout=5)
        assert server.max_model_len() == 256 and server.world_size() == 1
        fleet = ServerFleet([server], [1])
        fleet.pause(), fleet.resume(), fleet.start_weight_update(), fleet.finish_weight_update("3")
        assert fake.refused == 0 and fake.authorized >= 7

        monkeypatch.setenv(API_KEY_VARIABLE, "not-the-key")
        with pytest.raises(ConfigError) as refused:
            VLLMServer(fake.url, timeout=5).max_model_len()
        assert str(refused.value) == (f"the vLLM server at {fake.url} refused /v1/models: HTTP 401 Unauthorized (a wrong key "
                                      f"in {API_KEY_VARIABLE}): export {API_KEY_VARIABLE} with the server's key where the "
                                      "trainer runs")
        monkeypatch.delenv(API_KEY_VARIABLE)
        with pytest.raises(ConfigError, match=re.escape(f"HTTP 401 Unauthorized (no key in {API_KEY_VARIABLE})")):
            ServerFleet([VLLMServer(fake.url, timeout=5)], [1]).pause()
    finally:
        fake.stop()
