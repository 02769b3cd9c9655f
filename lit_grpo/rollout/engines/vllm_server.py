"""vLLM servers as the generation engine (``model.generation_backend: vllm_server``).

Generation runs on one or more vLLM servers that the user started on other GPUs or nodes
(``model.vllm_server_urls``; ``lit-grpo serve``, or ``vllm serve`` with the flags it adds). The
trainer talks to vLLM's own HTTP API, nothing of lit-grpo's (its requests:
:mod:`lit_grpo.rollout.engines.vllm_server_api`):

* sampling: ``/inference/v1/generate`` (tokens in, tokens out), one request per prompt with the
  colocated engine's sampling requests (:mod:`lit_grpo.rollout.engines.vllm_sampling`): same stop ids,
  greedy handling and processed log-probs. Seeds: each call draws one seed from the rank's
  checkpointed torch generator, as the colocated engine does, and prompt i's request is seeded with
  ``seed + i*G``. A shared server cannot have its global generator seeded per call (the colocated
  engine's way, which samples a batch at once), so every request carries its own seed: the tokens
  depend only on the weights, the prompt and the seed, whichever server samples them. Every rank
  sends its own prompts; the requests are spread over the servers.
* weights: vLLM's weight-transfer API (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``), driven by vLLM's trainer-side engines: ``nccl``
  from a GPU trainer, ``gloo`` (:mod:`lit_grpo.rollout.engines.vllm_gloo`) from a CPU one. Rank 0 sends,
  broadcasting each tensor once to every worker of every server (one group); the policy goes as
  :class:`~lit_grpo.rollout.engines.vllm_gloo.PolicyWeights` (LoRA merged, FSDP2 shards gathered one
  parameter at a time, a collective every rank joins). Generation is paused around the update and
  the prefix cache emptied after it; the update is labelled with the policy's version, which the
  server writes on every completion it samples (vLLM's ``weight_versions``): each rollout row says
  which weights made it, and a completion sampled with other weights than the last pushed (a server
  restarted mid-run) is refused.
* faults: a server that does not answer at start is one error line naming its URL, and so is one
  whose ``max_model_len`` is shorter than ``model.max_prompt_length + model.max_completion_length``
  or that was started without the weight transfer. Mid-run, "slow" is not "lost": a sampling
  request has no read timeout (a healthy server may take as long as its completions need), and
  while requests are out their servers' ``/health`` is checked; a server that does not answer it,
  or refuses connections, for ``model.vllm_server_timeout`` seconds is lost (requests that could not
  reach it are retried meanwhile, with exponential backoff, as TRL's client does). A weight push is
  bounded the same way: a push that takes no tensor for the timeout (a receiver died: an NCCL
  broadcast would never return) is abandoned, its group shut down (:class:`WeightPush`). Every
  failure of a sampling call (lost server, a request refused, an answer cut off or not what was
  asked for) is agreed on every rank, which raise
  :class:`~lit_grpo.rollout.engines.server_lost.GenerationFailed` (for a lost server its subclass
  :class:`~lit_grpo.rollout.engines.server_lost.GenerationServerLost`) at the same point; the run writes a
  checkpoint and stops with one line (:mod:`lit_grpo.rollout.engines.server_lost`).
"""

from __future__ import annotations

import ipaddress
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

import torch
from transformers import GenerationConfig

from lit_grpo.errors import ConfigError, DataError
from lit_grpo.redaction import redact_message  # the URLs printed: their credentials redacted
from lit_grpo.rollout.engines.base import GenerationEngine, agreed_failure, any_rank
from lit_grpo.rollout.engines.server_lost import GenerationFailed, GenerationServerLost
from lit_grpo.rollout.engines.vllm_sampling import (
    EngineOutput,
    check_vllm_generation_kwargs,
    draw_engine_seed,
    engine_rollout,
    process_rank,
    sampling_requests,
    sampling_settings,
    vllm_generation_kwargs,
)
from lit_grpo.rollout.engines.vllm_server_api import (
    HEALTH_TIMEOUT,
    MAX_CONCURRENT_REQUESTS,
    ServerFleet,
    ServerUnavailable,
    VLLMServer,
    failure_reason,
    in_background,
)
from lit_grpo.rollout.records import Rollout

__all__ = ["VLLMServerEngine", "WeightPush"]

WATCH_INTERVAL = 10.0  # seconds between two looks at requests and pushes in flight (at most timeout / 4)


class WeightPush:
    """Rank 0's push of one pass of the policy's weights, bounded.

    vLLM's trainer-side engine ``transfer`` sends (its HTTP calls and the broadcast) in a thread of
    its own, fed one tensor at a time through :meth:`forward` by the caller, which iterates the
    policy: the FSDP2 gathers of that iteration are collectives of every rank, so the caller goes on
    to the end of the pass whatever happens to the push. A push that fails, or that takes no tensor
    (or does not finish) for ``timeout`` seconds (a receiver died: an NCCL broadcast never returns),
    is abandoned: its group is shut down (NCCL's communicator aborted), the rest of the pass is
    gathered and dropped, and :meth:`finish` returns the failure."""

    def __init__(self, transfer: Any, metadata: list, timeout: float, servers: list[VLLMServer],
                 device: torch.device) -> None:
        from lit_grpo.rollout.engines.vllm_gloo import ForwardedWeights

        self.transfer, self.timeout, self.servers = transfer, timeout, servers
        self.handed: queue.Queue = queue.Queue(maxsize=1)  # one tensor at a time: the push holds no more
        self.failure: Exception | None = None
        transfer.source = ForwardedWeights(metadata, self.handed)
        self.sent = in_background(self._send, device)

    def _send(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a new thread starts on device 0: NCCL's calls go on the policy's
        self.transfer.send_weights()

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def forward(self, item: tuple[str, torch.Tensor] | None) -> None:
        """Hand ``item`` (None: the end of the pass) to the sending thread; nothing once the push failed."""
        waiting_since = time.monotonic()
        # by hand, not tenacity: a bounded wait on a queue that also watches the sending thread, not a retry
        while self.failure is None:
            if self.sent.done():  # it stopped before the end of the pass: it failed
                self.failure = self.sent.exception() or RuntimeError("the weight transfer ended before the pass")
                return
            try:
                self.handed.put(item, timeout=min(WATCH_INTERVAL, self.timeout / 4))
                return
            except queue.Full:
                if time.monotonic() - waiting_since >= self.timeout:
                    self._abandon("took no tensor")

    def finish(self) -> Exception | None:
        """The end of the pass: wait for the push to finish (bounded); what made it fail, if anything."""
        self.forward(None)
        waiting_since = time.monotonic()
        while self.failure is None:  # by hand: a bounded wait on a future (concurrent.futures.wait), not a retry
            if wait([self.sent], timeout=min(WATCH_INTERVAL, self.timeout / 4)).done:
                self.failure = self.sent.exception()  # None: sent
                break
            if time.monotonic() - waiting_since >= self.timeout:
                self._abandon("did not finish")
        return self.failure

    def _abandon(self, what: str) -> None:
        silent = [server.url for server in self.servers if not server.answers()]
        self.failure = GenerationServerLost(
            f"the weight push to the vLLM server(s) {', '.join(server.url for server in self.servers)} {what} for "
            f"{self.timeout:g} s (model.vllm_server_timeout)" + (f"; not answering: {', '.join(silent)}" if silent else ""))
        # the group is broken: shut it down (NCCL: an abort, which ends the broadcast stuck on the device)
        try:
            in_background(self.transfer.shutdown).result(timeout=HEALTH_TIMEOUT)
        except Exception:  # noqa: BLE001 - a group whose other side is gone; a shutdown that hangs
            pass


class VLLMServerEngine(GenerationEngine):
    """``model.generation_backend: vllm_server``: the servers at ``urls`` sample; ``timeout`` is
    ``model.vllm_server_timeout``; ``longest_request``: ``(max_prompt_length, max_completion_length)``
    each server must take, checked at :meth:`start` (None: not checked, e.g. tool calls, whose
    rollouts are bounded by the servers' length as they grow) (see the module's docstring)."""

    holds_weights = True
    samples_elsewhere = True  # its sampler() may run while the trainer trains (lit_grpo.rollout.async_pipeline)
    sampling_filter_order = "vllm"  # min-p before top-k and top-p (lit_grpo.algorithm.sampling_filters)
    can_lose_servers = True  # a lost server: a checkpoint, then a stop (CheckpointWhenServerLost)

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
    def check_run(cls, hp) -> None:
        """The vllm extra is installed (vLLM's trainer-side weight transfer), the settings are sound."""
        from lit_grpo.rollout.engines.vllm_colocated import require_vllm

        require_vllm()
        cls.check_settings(hp)
        check_vllm_generation_kwargs(hp)  # model.generation_kwargs are SamplingParams arguments

    @classmethod
    def for_run(cls, hp, model_source: Any = None, precision: str | None = None,
                grows_with_tools: bool = False) -> VLLMServerEngine:
        """The engine of a run with settings ``hp`` (the policy's source and precision are the servers')."""
        longest = None if grows_with_tools else (hp.max_prompt_length, hp.max_completion_length)
        return cls(cls.check_settings(hp), float(hp.vllm_server_timeout), longest, vllm_generation_kwargs(hp))

    def __init__(self, urls: list[str], timeout: float, longest_request: tuple[int | None, int] | None = None,
                 extra_arguments: dict | None = None) -> None:
        from lit_grpo.rollout.engines.vllm_colocated import require_vllm

        require_vllm()  # vLLM's trainer-side weight transfer
        self.timeout = timeout
        self.extra_arguments = dict(extra_arguments or {})  # of every request, as JSON (vllm_generation_kwargs)
        self.longest_request = longest_request
        self.servers = [VLLMServer(url, timeout) for url in urls]
        # requests in flight from this process, all calls together (the async pipeline's and validation's)
        self.request_slots = threading.BoundedSemaphore(MAX_CONCURRENT_REQUESTS)
        self.fleet: ServerFleet | None = None
        self.transfer = None  # vLLM's trainer-side weight-transfer engine (rank 0), opened at the first push
        self.pushed_version: int | None = None
        self.max_model_lens: list[int] | None = None

    def start(self) -> None:
        for server in self.servers:
            server.wait_until_up()
        self.max_model_lens = [server.max_model_len() for server in self.servers]
        if self.longest_request is None:
            return
        prompt, completion = self.longest_request
        for server, max_model_len in zip(self.servers, self.max_model_lens):
            if (prompt or 1) + completion > max_model_len:
                asked = (f"model.max_prompt_length + model.max_completion_length = {prompt} + {completion} tokens"
                         if prompt is not None else f"model.max_completion_length = {completion} tokens and a prompt")
                raise ConfigError(
                    f"{asked} is longer than the vLLM server at {server.url} takes (its max_model_len, {max_model_len}): "
                    f"lower them, or start the server with --max-model-len {(prompt or 1) + completion} or more")

    def max_sequence_length(self) -> int:
        return min(self.max_model_lens or [server.max_model_len() for server in self.servers])

    # -- weights ---------------------------------------------------------------------------------

    def sync_weights(self, policy: torch.nn.Module, version: int) -> float:
        """Push ``policy`` to every server unless they hold ``version`` already (every rank calls it;
        rank 0 sends); the seconds it took. A push that fails is tried again once the servers answer
        (a restarted server takes the weights like a new one), for up to the timeout. Whatever fails,
        every rank goes through the whole pass of the policy's weights (rank 0 without sending),
        then through the same agreement: no rank is left in a collective the others never reach."""
        if version == self.pushed_version:
            return 0.0
        start, deadline = time.perf_counter(), None
        sends = process_rank() == 0
        device = next(policy.parameters()).device
        while True:  # by hand, not tenacity: every rank agrees on each try's outcome (a collective) before the next
            failure = self._push(policy, version, sends)
            if not any_rank(failure is not None, device):
                break
            self._leave_transfer()  # its group is broken: a new one with the servers that answer
            if isinstance(failure, (ConfigError, DataError)) or not sends:
                lost = failure
                if failure is not None and sends and self.pushed_version is not None:
                    # mid-run (a server restarted without the transfer, say): a checkpoint first, then the line
                    lost = GenerationFailed(str(failure))
            else:
                deadline = deadline or time.monotonic() + self.timeout
                lost = None if self._wait_for_servers(deadline, failure) else failure
            agreed_failure(lost, device)
        self.pushed_version = version
        return time.perf_counter() - start

    def _push(self, policy: torch.nn.Module, version: int, sends: bool) -> Exception | None:
        """One pass of the policy's weights, labelled ``version`` and sent by rank 0 (:class:`WeightPush`);
        the error that stopped the push, if any."""
        from lit_grpo.rollout.engines.vllm_gloo import PolicyWeights

        weights = PolicyWeights(policy, sends=sends)  # iterating it: FSDP2's gathers, which every rank joins
        push, failure = None, None
        if sends:
            try:
                if self.transfer is None:
                    self.transfer = self._open_transfer(policy)
                self.fleet.pause()
                self.fleet.version = str(version)
                push = WeightPush(self.transfer, weights.metadata(), self.timeout, self.servers,
                                  next(policy.parameters()).device)
            except Exception as error:  # noqa: BLE001 - the other ranks are in the pass: this rank goes through it too
                failure = error
        if push is not None or weights.sharded:
            for item in weights:
                if push is not None:
                    push.forward(item)
                    if push.failed and not weights.sharded:  # no other rank waits for the rest of the pass
                        break
        if push is not None:
            failure = push.finish()
        if sends and failure is None:
            try:
                self.fleet.resume()
            except Exception as error:  # noqa: BLE001
                failure = error
        if failure is None or isinstance(failure, (ConfigError, DataError, GenerationServerLost)):
            return failure
        # an HTTP error, a broken gloo or NCCL group: a server is gone
        return GenerationServerLost(f"could not push the weights to the vLLM server(s) {self._urls()}: "
                                    f"{type(failure).__name__}: {failure_reason(failure)}")

    def _wait_for_servers(self, deadline: float, failure: Exception) -> bool:
        """Whether every server answers again before ``deadline`` (asked every second; said once on stderr)."""
        from tenacity import Retrying, retry_if_result, wait_fixed

        print(redact_message(f"{failure}: waiting up to {self.timeout:g} s for the server(s) to answer "  # URLs' passwords
                             "(model.vllm_server_timeout), then a checkpoint and a stop"), file=sys.stderr, flush=True)
        if time.monotonic() >= deadline:  # tenacity asks at least once; a deadline passed asks no more
            return False
        retrying = Retrying(retry=retry_if_result(lambda answer: not answer), wait=wait_fixed(1.0),
                            stop=lambda state: time.monotonic() >= deadline, retry_error_callback=lambda state: False)
        # a try after a sleep that passed the deadline asks no server (as the loop before tenacity)
        return retrying(lambda: time.monotonic() < deadline and all(server.answers() for server in self.servers))

    def _leave_transfer(self) -> None:
        if self.transfer is not None:
            try:
                in_background(self.transfer.shutdown).result(timeout=HEALTH_TIMEOUT)
            except Exception:  # noqa: BLE001 - a group whose other side is gone
                pass
            self.transfer = None

    def _open_transfer(self, policy: torch.nn.Module):
        """vLLM's trainer-side engine for this policy (rank 0's), joined with every server's workers."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.utils.network_utils import get_ip, get_open_port

        from lit_grpo.rollout.engines.vllm_gloo import GlooTrainerInitInfo, PolicyWeights, local_address_toward
        from lit_grpo.rollout.engines.vllm_plugin import register

        register()  # vLLM loads plugins in its own processes; this one is the trainer
        backend = "nccl" if next(policy.parameters()).device.type == "cuda" else "gloo"
        for server in self.servers:  # a server without it refuses the transfer (after the trainer's rendezvous)
            if server.weight_transfer_backend() not in (backend, "unknown"):
                raise self._started_without(server, backend)
        world_sizes = [server.world_size() for server in self.servers]
        self.fleet = ServerFleet(self.servers, world_sizes)
        remote = [server.host for server in self.servers if not _is_loopback(server.host)]
        world_size = 1 + sum(world_sizes)
        if backend == "nccl":
            init_info = NCCLTrainerInitInfo("127.0.0.1" if not remote else get_ip(), get_open_port(), world_size, rank=0)
        else:  # the group's store listens on this address only (VLLM_HOST_IP, or the route to the servers), any free port
            address = local_address_toward(remote[0]) if remote else "127.0.0.1"
            init_info = GlooTrainerInitInfo(address, 0, world_size, timeout_seconds=self.timeout, rank=0)
        try:
            return WeightTransferTrainerFactory.trainer_init(init_info, client=self.fleet,
                                                             source=PolicyWeights(policy, sends=True))
        except (DataError, ServerUnavailable) as error:  # a server without that transfer engine refuses the init
            if isinstance(error, ServerUnavailable) and "weight transfer not configured" not in str(error).lower():
                raise
            raise self._started_without(None, backend, error) from error

    def _started_without(self, server: VLLMServer | None, backend: str, error: Exception | None = None) -> ConfigError:
        where = f"the vLLM server at {server.url}" if server is not None else f"a vLLM server of {self._urls()}"
        return ConfigError(
            f"{where} takes no {backend} weight transfer{f' ({error})' if error else ''}: start it with "
            f"--weight-transfer-config '{{\"backend\": \"{backend}\"}}' (lit-grpo serve does: {backend} from a "
            f"{'GPU' if backend == 'nccl' else 'CPU'} trainer)")

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
        rollout, or the :class:`GenerationFailed` that stopped it (it never raises), which every rank
        then passes to :meth:`agree_on_failure` at the same point (``lit_grpo.rollout.async_pipeline``)."""
        if len(prompt_ids) == 0:
            return lambda stop=None: (None, None)
        seed = draw_engine_seed()
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        requests = sampling_requests(prompts, num_generations, seed=seed, extra_arguments=self.extra_arguments,
                                     **sampling_settings(config))
        pushed_version = self.pushed_version

        def sample(stop: threading.Event | None = None) -> tuple[Rollout | None, Exception | None]:
            try:
                output = self.sample(requests, stop)
                versions = [int(version) if version is not None else pushed_version for version in output.weight_versions]
                rollout = engine_rollout(output, prompt_ids, prompt_mask, prompt_truncated, num_generations, pad_token_id,
                                         versions)
            except Exception as error:  # noqa: BLE001 - every failure is agreed on every rank (agree_on_failure)
                return None, self._sampling_failure(error)
            return rollout, None

        return sample

    def agree_on_failure(self, failure: Exception | None, device: torch.device) -> None:
        """Raise on every rank when a sampling call failed on any (every rank calls it at the same
        point): the first failing rank's :class:`GenerationFailed`, with its message."""
        agreed_failure(failure, device)

    def _sampling_failure(self, error: Exception) -> GenerationFailed:
        if isinstance(error, GenerationFailed):
            return error
        if isinstance(error, (ConfigError, DataError)):  # a request the server refused (4xx): it names the server
            return GenerationFailed(str(error))
        return GenerationFailed(f"sampling on the vLLM server(s) {self._urls()} failed: {type(error).__name__}: "
                                f"{failure_reason(error)}")

    def sample(self, requests: list[tuple[list[int], dict]], stop: threading.Event | None = None) -> EngineOutput:
        """The completions of ``requests`` (:func:`~lit_grpo.rollout.engines.vllm_sampling.sampling_requests`), in
        order: all sent at once (at most ``MAX_CONCURRENT_REQUESTS`` in flight), request j to server
        ``(j + rank) % servers``; while they are out, the servers that have some must answer ``/health``.
        ``stop`` set (the run ends): :class:`GenerationFailed` within a watch interval, not waiting for
        the answers (their threads are daemons)."""
        rank = process_rank()
        targets = [self.servers[(index + rank) % len(self.servers)] for index in range(len(requests))]
        abandoned = threading.Event()
        said: set[str] = set()  # the servers said to be not answering

        def say(server: VLLMServer, message: str) -> None:
            if server.url not in said:
                said.add(server.url)
                print(redact_message(message), file=sys.stderr, flush=True)  # a server URL's password redacted

        def answer(server: VLLMServer, body: dict) -> dict:
            with self.request_slots:
                return server.generate(body, abandoned, say)

        answers = [in_background(answer, server, {"token_ids": prompt, "sampling_params": params})
                   for server, (prompt, params) in zip(targets, requests)]
        try:
            self._watch(answers, targets, say, stop)
            output = EngineOutput()
            for answer_, server, (_, params) in zip(answers, targets, requests):
                choices = sorted(answer_.result()["choices"], key=lambda choice: choice["index"])
                if len(choices) != params["n"]:
                    raise GenerationFailed(f"the vLLM server at {server.url} returned {len(choices)} completions, "
                                           f"not {params['n']}")
                for choice in choices:
                    output.add(*self._completion(server, choice))
            return output
        finally:
            abandoned.set()  # requests still retrying stop (after a failure)

    def _watch(self, answers: list[Future], targets: list[VLLMServer], say: Callable[[VLLMServer, str], None],
               stop: threading.Event | None = None) -> None:
        """Return once every answer is in; the failure of the first that failed, or
        :class:`GenerationServerLost` when a server with requests out has not answered ``/health``
        for the timeout (slow is fine, silent is not)."""
        interval = min(WATCH_INTERVAL, self.timeout / 4)
        answered = {server.url: time.monotonic() for server in targets}  # when each last answered /health
        pending = set(answers)
        while pending:  # by hand: concurrent.futures.wait in slices, the servers' /health asked between them
            if stop is not None and stop.is_set():
                raise GenerationFailed(f"the run stopped while the vLLM server(s) {self._urls()} sampled")
            done, pending = wait(pending, timeout=interval, return_when=FIRST_EXCEPTION)
            for answer in done:
                if answer.exception() is not None:
                    raise answer.exception()
            now = time.monotonic()
            for server in {targets[index].url: targets[index] for index, answer in enumerate(answers) if answer in pending}.values():
                silence = server.silence()
                if silence is None:
                    answered[server.url] = now
                    continue
                say(server, f"the vLLM server at {server.url} is not answering (/health: {silence}): waiting up to "
                    f"{self.timeout:g} s for it (model.vllm_server_timeout), then a checkpoint and a stop")
                if now - answered[server.url] >= self.timeout:
                    raise GenerationServerLost(f"the vLLM server at {server.url} has not answered for {self.timeout:g} s "
                                               f"(model.vllm_server_timeout): /health: {silence}")

    def _completion(self, server: VLLMServer, choice: dict) -> tuple[list[int], list[float], str, str | None]:
        """``(tokens, their log-probs, finish reason, weight version)`` of one completion, checked: the
        log-probs are the sampled tokens', and the weights the last pushed."""
        tokens = list(choice["token_ids"])
        content = (choice.get("logprobs") or {}).get("content") or []
        if [entry["token_id"] for entry in content] != tokens:
            raise GenerationFailed(f"the vLLM server at {server.url} returned log-probs that are not its sampled tokens' "
                                   "(was it started with lit-grpo serve's --logprobs-mode processed_logprobs?)")
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
            for server in self.servers:
                try:
                    server.request("POST", "/shutdown_weight_transfer_engine", timeout=HEALTH_TIMEOUT)
                except Exception:  # noqa: BLE001 - a server that is gone has nothing to shut down
                    pass
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
