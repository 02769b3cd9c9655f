"""vLLM servers as the generation engine (``model.generation_backend: vllm_server``).

Generation runs on one or more vLLM servers that the user started on other GPUs or nodes
(``model.vllm_server_urls``; ``lit-grpo serve``, or ``vllm serve`` with the flags it adds). The
trainer talks to vLLM's own HTTP API, nothing of lit-grpo's:

* sampling: ``/inference/v1/generate`` (tokens in, tokens out), one request per prompt with the
  colocated engine's sampling requests (:mod:`lit_grpo.engines.vllm_sampling`): same stop ids,
  greedy handling and processed log-probs. Seeds: each call draws one seed from the rank's
  checkpointed torch generator, as the colocated engine does, and prompt i's request is seeded with
  ``seed + i*G``. A shared server cannot have its global generator seeded per call (the colocated
  engine's way, which samples a batch at once), so every request carries its own seed: the tokens
  depend only on the weights, the prompt and the seed, whichever server samples them. Every rank
  sends its own prompts; the requests are spread over the servers.
* weights: vLLM's weight-transfer API (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``), driven by vLLM's trainer-side engines: ``nccl``
  from a GPU trainer, ``gloo`` (:mod:`lit_grpo.engines.vllm_gloo`) from a CPU one. Rank 0 sends,
  broadcasting each tensor once to every worker of every server (one group); the policy goes as
  :class:`~lit_grpo.engines.vllm_gloo.PolicyWeights` (LoRA merged, FSDP2 shards gathered one
  parameter at a time, a collective every rank joins). Generation is paused around the update and
  the prefix cache emptied after it; the update is labelled with the policy's version, which the
  server writes on every completion it samples (vLLM's ``weight_versions``): each rollout row says
  which weights made it, and a completion sampled with other weights than the last pushed (a server
  restarted mid-run) is refused.
* faults: a server that does not answer at start is one error line naming its URL. Mid-run, a
  request that fails is retried for up to ``model.vllm_server_timeout`` seconds, with a message; then
  every rank raises :class:`~lit_grpo.engines.server_lost.GenerationServerLost` at the same point
  and the run writes a checkpoint and stops (:mod:`lit_grpo.engines.server_lost`).
"""

from __future__ import annotations

import ipaddress
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import torch
from transformers import GenerationConfig

from lit_grpo.engines.base import GenerationEngine, agreed_failure, any_rank
from lit_grpo.engines.server_lost import GenerationServerLost
from lit_grpo.engines.vllm_sampling import (
    EngineOutput,
    draw_engine_seed,
    engine_rollout,
    process_rank,
    sampling_requests,
    sampling_settings,
)
from lit_grpo.errors import ConfigError, DataError
from lit_grpo.rollout import Rollout

__all__ = ["ServerFleet", "VLLMServer", "VLLMServerEngine"]

# At most this many requests in flight from one trainer process (vLLM batches them on its side).
MAX_CONCURRENT_REQUESTS = 64


class ServerUnavailable(Exception):
    """A request a server did not answer (refused, reset, a 5xx); worth retrying for a while."""


class VLLMServer:
    """One vLLM server: its URL, and requests to its HTTP API that name it when they fail."""

    def __init__(self, url: str, timeout: float) -> None:
        import requests

        parsed = urlparse(url if "://" in url else f"http://{url}")
        if not parsed.hostname or not parsed.port:
            raise ConfigError(f"model.vllm_server_urls: {url!r} is not a server address like http://HOST:PORT")
        self.url = f"{parsed.scheme}://{parsed.netloc}{parsed.path}".rstrip("/")
        self.host = parsed.hostname
        self.timeout = timeout
        self.session = requests.Session()

    def request(self, method: str, path: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """The JSON answer of ``method path``. :class:`ServerUnavailable` when the server does not
        answer (or answers 5xx); a :class:`~lit_grpo.errors.DataError` naming the server for a
        request it refuses (4xx); ``requests``' ``Timeout`` after ``timeout`` seconds."""
        import requests

        try:
            response = self.session.request(method, self.url + path, timeout=timeout or self.timeout, **kwargs)
        except requests.Timeout:
            raise
        except requests.ConnectionError as error:
            raise ServerUnavailable(f"{type(error).__name__}: {_reason(error)}") from error
        if response.status_code >= 500:
            raise ServerUnavailable(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            raise DataError(f"the vLLM server at {self.url} refused {path}: HTTP {response.status_code} {response.text[:500]}")
        return response.json() if response.content else None

    def wait_until_up(self) -> None:
        """Return once the server answers ``/health``; a one-line error naming it after the timeout."""
        started = time.monotonic()
        while True:
            try:
                self.request("GET", "/health", timeout=5)
                return
            except (ServerUnavailable, OSError) as error:
                reason = str(error)
            except Exception as error:  # noqa: BLE001 - a timeout, an answer that is not vLLM's
                reason = f"{type(error).__name__}: {error}"
            if time.monotonic() - started >= self.timeout:
                raise ConfigError(
                    f"model.vllm_server_urls: no vLLM server answers at {self.url} ({reason}; waited "
                    f"{self.timeout:g} s, model.vllm_server_timeout): start one there (lit-grpo serve MODEL --port "
                    f"{urlparse(self.url).port}) or fix the URL")
            time.sleep(1.0)

    def answers(self) -> bool:
        """Whether the server answers ``/health`` now."""
        try:
            self.request("GET", "/health", timeout=5)
            return True
        except Exception:  # noqa: BLE001 - refused, reset, timed out, an error status
            return False

    def max_model_len(self) -> int:
        return int(self.request("GET", "/v1/models")["data"][0]["max_model_len"])

    def world_size(self) -> int:
        """The server's workers (tensor x pipeline x data parallel): each joins the weight transfer."""
        return int(self.request("GET", "/get_world_size")["world_size"])


class ServerFleet:
    """Every server of the run as one receiver of weights: vLLM's ``VLLMWeightSyncClient`` protocol,
    each call made on all servers at once (their workers receive the same broadcast, so they must be
    in it together). Server j's workers take the ranks after those of the servers before it.
    ``version``: the label of the update being sent (the policy's version)."""

    def __init__(self, servers: list[VLLMServer], world_sizes: list[int], executor: ThreadPoolExecutor) -> None:
        self.servers, self.world_sizes, self.executor = servers, world_sizes, executor
        self.version: str | None = None

    def _on_every_server(self, path: str, bodies: list[Any] | None = None, **kwargs: Any) -> None:
        bodies = bodies if bodies is not None else [None] * len(self.servers)
        calls = [self.executor.submit(server.request, "POST", path, json=body, **kwargs)
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


class VLLMServerEngine(GenerationEngine):
    """``model.generation_backend: vllm_server``: the servers at ``urls`` sample; ``timeout`` is
    ``model.vllm_server_timeout`` (see the module's docstring)."""

    holds_weights = True
    samples_elsewhere = True  # its sampler() may run while the trainer trains (lit_grpo.async_rollouts)

    @staticmethod
    def check_settings(hp) -> list[str]:
        """``model.vllm_server_urls`` as a list, after checking it and ``model.vllm_server_timeout``."""
        urls = hp.vllm_server_urls
        urls = [urls] if isinstance(urls, str) else list(urls or [])
        if not urls:
            raise ConfigError("model.generation_backend: vllm_server samples on vLLM servers: give their addresses in "
                              "model.vllm_server_urls, e.g. [http://localhost:8000] (README: Generation servers)")
        if not hp.vllm_server_timeout or hp.vllm_server_timeout <= 0:
            raise ConfigError(f"model.vllm_server_timeout must be a number of seconds above 0, got {hp.vllm_server_timeout}")
        return urls

    @classmethod
    def for_run(cls, hp) -> "VLLMServerEngine":
        return cls(cls.check_settings(hp), float(hp.vllm_server_timeout))

    def __init__(self, urls: list[str], timeout: float) -> None:
        from lit_grpo.engines.vllm_colocated import require_vllm

        require_vllm()  # vLLM's trainer-side weight transfer
        self.timeout = timeout
        self.servers = [VLLMServer(url, timeout) for url in urls]
        self.executor = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_REQUESTS, thread_name_prefix="vllm-server")
        self.fleet: ServerFleet | None = None
        self.transfer = None  # vLLM's trainer-side weight-transfer engine, opened at the first push
        self.pushed_version: int | None = None

    def start(self) -> None:
        for server in self.servers:
            server.wait_until_up()

    def max_sequence_length(self) -> int:
        return min(server.max_model_len() for server in self.servers)

    # -- weights ---------------------------------------------------------------------------------

    def sync_weights(self, policy: torch.nn.Module, version: int) -> float:
        """Push ``policy`` to every server unless they hold ``version`` already (every rank calls it;
        rank 0 sends); the seconds it took. A push that fails is tried again once the servers answer
        (a restarted server takes the weights like a new one), for up to the timeout."""
        if version == self.pushed_version:
            return 0.0
        start, deadline = time.perf_counter(), None
        sends = process_rank() == 0
        device = next(policy.parameters()).device
        while True:
            failure = self._push(policy, version, sends)
            if not any_rank(failure is not None, device):
                break
            self._leave_transfer()  # its group is broken: a new one with the servers that answer
            if isinstance(failure, (ConfigError, DataError)) or not sends:
                lost = failure
            else:
                deadline = deadline or time.monotonic() + self.timeout
                lost = None if self._wait_for_servers(deadline, failure) else failure
            agreed_failure(lost, device, lambda: GenerationServerLost(
                f"rank 0 could not push the weights to the vLLM server(s) {self._urls()}"))
        self.pushed_version = version
        return time.perf_counter() - start

    def _push(self, policy: torch.nn.Module, version: int, sends: bool) -> Exception | None:
        """One push of the weights labelled ``version``; the error that stopped it, if any."""
        from lit_grpo.engines.vllm_gloo import PolicyWeights

        try:
            if self.transfer is None:
                self.transfer = self._open_transfer(policy, sends)
            self.transfer.source = PolicyWeights(policy, sends=sends)  # this policy's weights, as they are now
            if sends:
                self.fleet.pause()
                self.fleet.version = str(version)
            try:
                self.transfer.send_weights()
            finally:
                self.transfer.source.finish_pass()  # after a failure: the other ranks' gathers go on
            if sends:
                self.fleet.resume()
        except (ConfigError, DataError) as error:
            return error
        except Exception as error:  # noqa: BLE001 - an HTTP error, a broken gloo or NCCL group: a server is gone
            return GenerationServerLost(f"could not push the weights to the vLLM server(s) {self._urls()}: "
                                        f"{type(error).__name__}: {_reason(error)}")
        return None

    def _wait_for_servers(self, deadline: float, failure: Exception) -> bool:
        """Whether every server answers again before ``deadline`` (said once on stderr)."""
        print(f"{failure}: waiting up to {self.timeout:g} s for the server(s) to answer (model.vllm_server_timeout), "
              "then a checkpoint and a stop", file=sys.stderr, flush=True)
        while time.monotonic() < deadline:
            if all(server.answers() for server in self.servers):
                return True
            time.sleep(1.0)
        return False

    def _leave_transfer(self) -> None:
        if self.transfer is not None:
            try:
                self.transfer.shutdown()
            except Exception:  # noqa: BLE001 - a group whose other side is gone
                pass
            self.transfer = None

    def _open_transfer(self, policy: torch.nn.Module, sends: bool):
        """vLLM's trainer-side engine for this policy, joined with every server's workers."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_ip, get_open_port

        from lit_grpo.engines.vllm_gloo import GlooTrainerInitInfo, PolicyWeights
        from lit_grpo.engines.vllm_plugin import register

        register()  # vLLM loads plugins in its own processes; this one is the trainer
        world_sizes = [server.world_size() for server in self.servers] if sends else [0] * len(self.servers)
        self.fleet = ServerFleet(self.servers, world_sizes, self.executor)
        loopback = all(_is_loopback(server.host) for server in self.servers)
        address, port = ("127.0.0.1" if loopback else get_ip()), get_open_port()
        world_size = 1 + sum(world_sizes)
        if next(policy.parameters()).device.type == "cuda":
            init_info = NCCLTrainerInitInfo(address, port, world_size, rank=process_rank())
        else:
            init_info = GlooTrainerInitInfo(address, port, world_size, timeout_seconds=self.timeout, rank=process_rank())
        try:
            return WeightTransferTrainerFactory.trainer_init(init_info, client=self.fleet,
                                                             source=PolicyWeights(policy, sends=sends))
        except DataError as error:  # a server without that transfer engine refuses the init
            backend = type(init_info).backend
            raise ConfigError(
                f"{error}: start the vLLM server(s) with --weight-transfer-config '{{\"backend\": \"{backend}\"}}' "
                f"(lit-grpo serve does: {backend} from a {'GPU' if backend == 'nccl' else 'CPU'} trainer)") from error

    # -- sampling --------------------------------------------------------------------------------

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_truncated: torch.Tensor,
                 num_generations: int, config: GenerationConfig, pad_token_id: int) -> Rollout | None:
        rollout, failure = self.sampler(prompt_ids, prompt_mask, prompt_truncated, num_generations, config, pad_token_id)()
        self.agree_on_failure(failure, prompt_ids.device)
        return rollout

    def sampler(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_truncated: torch.Tensor,
                num_generations: int, config: GenerationConfig, pad_token_id: int) -> Callable[[], tuple[Rollout | None, Exception | None]]:
        """:meth:`generate` in two halves: the seed is drawn now; the call returned sends the requests
        (HTTP only, no collective: any thread may make it, while the trainer trains) and returns the
        rollout, or the :class:`GenerationServerLost` that stopped it, which every rank then passes to
        :meth:`agree_on_failure` at the same point (``lit_grpo.async_rollouts``)."""
        if len(prompt_ids) == 0:
            return lambda: (None, None)
        seed = draw_engine_seed()
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        requests = sampling_requests(prompts, num_generations, seed=seed, **sampling_settings(config))
        pushed_version = self.pushed_version

        def sample() -> tuple[Rollout | None, Exception | None]:
            try:
                output = self.sample(requests)
            except GenerationServerLost as error:
                return None, error
            versions = [int(version) if version is not None else pushed_version for version in output.weight_versions]
            return engine_rollout(output, prompt_ids, prompt_mask, prompt_truncated, num_generations, pad_token_id, versions), None

        return sample

    def agree_on_failure(self, failure: Exception | None, device: torch.device) -> None:
        """Raise on every rank when a sampling call failed on any (every rank calls it at the same point)."""
        agreed_failure(failure, device, lambda: GenerationServerLost(f"another rank lost a vLLM server of {self._urls()}"))

    def sample(self, requests: list[tuple[list[int], dict]]) -> EngineOutput:
        """The completions of ``requests`` (:func:`~lit_grpo.engines.vllm_sampling.sampling_requests`), in
        order: all sent at once, request j to server ``(j + rank) % servers``."""
        rank = process_rank()
        answers = [self.executor.submit(self._answer, self.servers[(index + rank) % len(self.servers)],
                                        {"token_ids": prompt, "sampling_params": params})
                   for index, (prompt, params) in enumerate(requests)]
        output = EngineOutput()
        for answer, (_, params) in zip(answers, requests):
            server, response = answer.result()
            choices = sorted(response["choices"], key=lambda choice: choice["index"])
            if len(choices) != params["n"]:
                raise RuntimeError(f"the vLLM server at {server.url} returned {len(choices)} completions, not {params['n']}")
            for choice in choices:
                output.add(*self._completion(server, choice))
        return output

    def _answer(self, server: VLLMServer, body: dict) -> tuple[VLLMServer, dict]:
        """The server's answer to one sampling request, retried while the server does not answer, for
        up to the timeout from the first failure (a hang: the request's own timeout)."""
        import requests

        first_failure = None
        while True:
            try:
                return server, server.request("POST", "/inference/v1/generate", json=body)
            except requests.Timeout as error:
                raise GenerationServerLost(f"the vLLM server at {server.url} did not answer within {self.timeout:g} s "
                                           f"(model.vllm_server_timeout): {_reason(error)}") from error
            except ServerUnavailable as error:
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                    print(f"the vLLM server at {server.url} is not answering ({error}): waiting up to {self.timeout:g} s "
                          "for it (model.vllm_server_timeout), then a checkpoint and a stop", file=sys.stderr, flush=True)
                if now - first_failure >= self.timeout:
                    raise GenerationServerLost(f"the vLLM server at {server.url} has not answered for {self.timeout:g} s "
                                               f"(model.vllm_server_timeout): {error}") from error
                time.sleep(1.0)

    def _completion(self, server: VLLMServer, choice: dict) -> tuple[list[int], list[float], str, str | None]:
        """``(tokens, their log-probs, finish reason, weight version)`` of one completion, checked: the
        log-probs are the sampled tokens', and the weights the last pushed."""
        tokens = list(choice["token_ids"])
        content = (choice.get("logprobs") or {}).get("content") or []
        if [entry["token_id"] for entry in content] != tokens:
            raise RuntimeError(f"the vLLM server at {server.url} returned log-probs that are not its sampled tokens'")
        if choice["finish_reason"] not in ("stop", "length"):
            raise GenerationServerLost(f"the vLLM server at {server.url} ended a completion with {choice['finish_reason']!r}")
        spans = choice.get("weight_versions") or []
        versions = {span["version"] for span in spans}
        if versions and versions != {str(self.pushed_version)}:
            raise GenerationServerLost(
                f"the vLLM server at {server.url} sampled with weights {sorted(versions)}, not the trainer's version "
                f"{self.pushed_version}: was it restarted?")
        return tokens, [entry["logprob"] for entry in content], choice["finish_reason"], spans[0]["version"] if spans else None

    def close(self) -> None:
        """Leave the servers' weight transfer (so that another run may join them), without waiting on a
        server that is gone."""
        if self.transfer is not None:
            self._leave_transfer()
            if process_rank() == 0:
                for server in self.servers:
                    try:
                        server.request("POST", "/shutdown_weight_transfer_engine", timeout=5)
                    except Exception:  # noqa: BLE001 - a server that is gone has nothing to shut down
                        pass
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.pushed_version = None

    def _urls(self) -> str:
        return ", ".join(server.url for server in self.servers)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reason(error: BaseException) -> str:
    """Why a request failed, in a few words (``[Errno 111] Connection refused``, ``timed out``)."""
    text = " ".join(str(error).split())
    errno = re.search(r"\[Errno -?\d+\] [^'\")(]+", text)
    if errno:
        return errno.group(0).strip()
    return "timed out" if "timed out" in text.lower() else text[:300]
