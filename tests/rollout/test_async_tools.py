"""Asynchronous GRPO (``model.max_staleness``, lit_grpo/rollout/async_pipeline.py) with multi-turn tools,
environments and dynamic sampling.

The in-process runs sample with the scripted policy (tests/scripted_policy.py: "once n" calls ``add`` once
and answers, "twice n" calls it twice), so every turn, tool call and reward is known by hand; the
pipeline's ``exchange`` is wrapped to record the batch each step trains. The process runs
(test_resume's ``lit-grpo fit``) are killed with SIGKILL and resumed with ``--ckpt_path last``.
"""

from __future__ import annotations

import io
import json
import signal
import string
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import lightning.pytorch as pl
import pytest
import scripted_policy
import torch
from test_async_rollouts import async_config, trained_prompts
from test_resume import REPO, checkpoint_at, fit_config, killed_during_step_after, lit_grpo_fit, logged_scalars
from transformers import AutoTokenizer

import lit_grpo.rollout.engines.policy
from lit_grpo import plugins
from lit_grpo.data import GRPODataModule
from lit_grpo.train.module import GRPOModule

ADD = "scripted_policy:add"


@pytest.fixture
def scripted(monkeypatch, tiny_qwen2_dir):
    """The module samples with the scripted policy (test_tools' fixture)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    monkeypatch.setattr(lit_grpo.rollout.engines.policy, "generate_from_ids",
                        lambda *args, **kwargs: scripted_policy.scripted_generate_from_ids(*args, **kwargs, tokenizer=tokenizer))


class Ledger:
    """An environment whose ``add`` tool records its calls; its reward is the sample's ``bonus`` column
    plus the calls made. Counts its live and closed instances, and the threads that built, stepped and
    closed them."""

    live = closed = 0
    threads: ClassVar[set] = set()

    def __init__(self, bonus: float):
        self.bonus, self.calls = bonus, 0
        Ledger.live += 1
        Ledger.threads.add(threading.current_thread().name)

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return self.bonus + self.calls

    def close(self) -> None:
        Ledger.live -= 1
        Ledger.closed += 1
        Ledger.threads.add(threading.current_thread().name)


@pytest.fixture
def ledger_environment():
    Ledger.live = Ledger.closed = 0
    Ledger.threads = set()
    plugin = plugins.register_functions("test-environments", environments={"ledger": Ledger})
    yield Ledger
    plugins.unregister_plugin(plugin)


def fit_recording(module: GRPOModule, data: GRPODataModule, trainer: pl.Trainer) -> tuple[list, list]:
    """Fit, recording every batch the pipeline hands to the update (None while it fills) and the
    metrics logged after each training step."""
    trained, metrics = [], []
    pipeline = module.rollout_pipeline
    exchange = pipeline.exchange

    def recording(module_, batch):
        scored, completions = exchange(module_, batch)
        trained.append(scored)
        return scored, completions

    pipeline.exchange = recording

    class Metrics(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            metrics.append({name: float(value) for name, value in trainer.callback_metrics.items()})

    trainer.callbacks.append(Metrics())
    trainer.fit(module, data)
    return trained, metrics


def questions(write_jsonl, rows: list[str], **columns) -> str:
    return str(write_jsonl([{"prompt": q, **{k: v[i] for k, v in columns.items()}} for i, q in enumerate(rows)]))


def test_one_step_off_with_tools_trains_each_multi_turn_batch_with_the_weights_that_sampled_its_turns(
        tiny_qwen2_dir, scripted, reward_plugin, write_jsonl, fast_trainer):
    reward_plugin(messages=lambda prompts, completions, **kw: [float(len(c)) for c in completions])
    module = GRPOModule(str(tiny_qwen2_dir), [{"name": "messages"}], num_generations=2, max_completion_length=200, tools=[ADD],
                        max_staleness=1, log_completions_every_n_steps=0, model_init_kwargs={"dtype": "float32"},
                        # a sequence-level correction (a wrong behaviour log-prob on any token of a row moves
                        # its ratio), unclipped: the ratios are logged as they are
                        vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=1e9,
                        # the scripted rows of a group are alike (no gradient): the weight decay moves the policy
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, weight_decay=1.0))
    data = GRPODataModule(path="json", data_files=questions(write_jsonl, ["once 1", "twice 2"] * 4), batch_size=2,
                          conversational=True, shuffle=False)
    trained, metrics = fit_recording(module, data, fast_trainer(max_steps=3))
    assert trained[0] is None and len(trained) == 4  # the first step fills the pipeline; 3 optimizer steps
    # batch n was sampled at step n by the weights of n - 1 optimizer steps before (0 for the first two)
    # and trained one step later; every turn of a row by the same weights (each row: its oldest turn's)
    assert [scored.rollout.weight_versions.tolist() for scored in trained[1:]] == [[0] * 4, [0] * 4, [1] * 4]
    assert [m["async/staleness_max"] for m in metrics[1:]] == [0.0, 1.0, 1.0]
    assert [m["async/staleness_mean"] for m in metrics[1:]] == [0.0, 1.0, 1.0]
    for scored in trained[1:]:
        rollout = scored.rollout
        # "once": a call, its result, the answer (2 turns); "twice": 2 calls and an answer (3 turns)
        assert [len(c.messages) for c in rollout.conversations] == [3, 3, 5, 5]
        policy, tool = rollout.policy_token_mask.bool(), (rollout.completion_mask * (1 - rollout.tool_mask)).bool()
        assert tool.any() and scored.loss_mask.bool().eq(policy).all()  # the tool messages: not in the loss
        # the behaviour log-probs: the sampling weights' of every policy token, 0 on the tool messages
        assert (rollout.sampling_logps[policy] < 0).all() and (rollout.sampling_logps[~policy] == 0).all()
    # the first trained batch was sampled and is trained by the same weights: its behaviour log-probs
    # are the trainer's (to rounding: one forward of the whole rows, and the update's of prompt and
    # completion apart); the next ones by weights one step older
    assert metrics[1]["sampling/sampling_logp_difference/max"] < 1e-5
    # so its rows' ratios (over the tokens of the loss: the tool messages' 0 would move them far) are 1
    for bound in ("min", "max"):
        assert metrics[1][f"sampling/importance_sampling_ratio/{bound}"] == pytest.approx(1.0, abs=1e-3)
    assert metrics[2]["sampling/sampling_logp_difference/mean"] > 1e-3
    assert [m["tools/calls_per_rollout"] for m in metrics[1:]] == [1.5] * 3  # (1 + 1 + 2 + 2) / 4
    assert [m["turns/mean"] for m in metrics[1:]] == [2.5] * 3
    assert [m["reward"] for m in metrics[1:]] == [4.0] * 3  # messages: (3 + 3 + 5 + 5) / 4


def test_environments_live_within_the_step_and_their_rewards_are_scored_in_the_background(
        tiny_qwen2_dir, scripted, reward_plugin, ledger_environment, write_jsonl, fast_trainer):
    """Each rollout's environment is built from its sample's columns, stepped by its tool calls and
    closed in the training step (the main thread); the background thread scores the ended rollouts
    with the environment's reward, read when each ended. The checkpoint's state holds the batch in
    flight with its conversations and the environments' rewards."""
    reward_plugin(zero=lambda prompts, completions, **kw: [0.0] * len(completions))
    module = GRPOModule(str(tiny_qwen2_dir), [{"name": "zero"}], num_generations=2, max_completion_length=200,
                        environment={"name": "ledger", "weight": 1.0}, max_staleness=1, log_completions_every_n_steps=0,
                        model_init_kwargs={"dtype": "float32"})
    data = GRPODataModule(path="json", data_files=questions(write_jsonl, ["once 1", "twice 2"] * 2, bonus=[10.0, 20.0] * 2),
                          batch_size=2, conversational=True, shuffle=False)
    trained, metrics = fit_recording(module, data, fast_trainer(max_steps=1))
    # once 1 + bonus 10: 11; twice 2 + bonus 20: 22 (two rows each)
    assert trained[1].rewards_per_func[:, 1].tolist() == [11.0, 11.0, 22.0, 22.0]
    assert metrics[1]["rewards/ledger/mean"] == pytest.approx(16.5)
    assert (Ledger.live, Ledger.closed) == (0, 8)  # 2 batches sampled x 4 rollouts, each closed once
    assert Ledger.threads == {"MainThread"}
    (in_flight,) = module.rollout_pipeline.state_dict()["per_rank"][0]  # the batch sampled at the last step
    saved = torch.load(_saved(in_flight), weights_only=True)  # plain data: a weights_only checkpoint reads it
    conversations = saved["rollout"]["conversations"]
    assert [c["environment_reward"] for c in conversations] == [11.0, 11.0, 22.0, 22.0]
    assert [c["tool_calls"] for c in conversations] == [1, 1, 2, 2]
    # the tokens are the rollout's tensors' alone (not again as lists in every conversation)
    assert not {"prompt_ids", "token_ids", "tool_mask", "sampling_logps"} & set(conversations[0])
    assert saved["rollout"]["completion_ids"].shape[0] == 4


def _saved(state: dict) -> io.BytesIO:
    """``state`` written by ``torch.save``, ready to read."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_a_pipeline_checkpoint_restores_multi_turn_batches_with_their_conversations():
    """A sampled, unscored multi-turn batch comes back from a checkpoint as conversations that score
    and count as before (the tools' functions and environment instances are not saved: ended)."""
    from lit_grpo.data import PromptBatch
    from lit_grpo.rollout.async_pipeline import InFlight
    from lit_grpo.rollout.records import Rollout
    from lit_grpo.rollout.tools.multi_turn import Conversation

    conversation = Conversation(prompt=[{"role": "user", "content": "once 1"}], prompt_ids=[1, 2], prompt_truncated=False,
                                tools={"add": object()}, environment="ledger", environment_instance=object(),
                                messages=[{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call00000",
                                                                                         "function": {"name": "add", "arguments": {"a": 1}}}]},
                                          {"role": "tool", "name": "add", "content": "2"}],
                                tool_calls=1, turns=2, environment_reward=11.0, weight_version=3, done=True)
    ones = torch.ones(1, 2, dtype=torch.long)
    rollout = Rollout(ones, ones, ones, ones, torch.zeros(1, dtype=torch.bool), tool_mask=ones, conversations=[conversation],
                      weight_versions=torch.tensor([3]))
    item = InFlight(PromptBatch(["once 1"], {}), {"generate": 0.0}, rollout=rollout)
    saved = torch.load(_saved(item.state()), weights_only=True)
    restored = InFlight.from_state(saved).rollout.conversations[0]
    assert (restored.messages, restored.environment, restored.environment_reward) == (conversation.messages, "ledger", 11.0)
    assert (restored.tool_calls, restored.turns, restored.weight_version) == (1, 2, 3)
    assert restored.tools == {} and restored.environment_instance is None


def test_a_verifiers_environment_trains_one_step_off(tmp_path, tiny_qwen2_dir):
    """examples/verifiers-plugin's adapter (a verifiers ToolEnv) with ``max_staleness: 1``: its rubric
    scores in the background, and every trained batch is logged one step after it was sampled."""
    pytest.importorskip("lit_grpo_verifiers", reason="pip install -e examples/verifiers-plugin (README: Tests)")
    args = {"environment": "vf-arithmetic", "environment_args": {"num_examples": 8, "num_eval_examples": 4, "seed": 3}}
    pl.seed_everything(0)
    module = GRPOModule(str(tiny_qwen2_dir), rewards=[{"name": "verifiers_rubric", "args": args}],
                        environment={"name": "verifiers", "args": args}, num_generations=2, max_completion_length=8,
                        max_staleness=1, model_init_kwargs={"dtype": "float32"}, log_completions_every_n_steps=0,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    logger = pl.loggers.CSVLogger(tmp_path)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, log_every_n_steps=1, logger=logger,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, datamodule=GRPODataModule(path="verifiers", args=args, batch_size=2))
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    column = lambda name: [row.split(",")[header.index(name)] for row in rows[1:] if row.split(",")[header.index(name)]]
    assert [float(value) for value in column("async/staleness_max")] == [0.0, 1.0]
    assert len(column("rewards/num_turns/mean")) == 2 and all(float(value) >= 1 for value in column("rewards/num_turns/mean"))
    assert len(column("tools/calls_per_rollout")) == 2


# ----------------------------------------------------------------------------------------------
# Dynamic sampling
# ----------------------------------------------------------------------------------------------


def gated(prompts, completions, **kwargs):
    """Constant 1.0 for "Say z:" (a group without signal), else the fraction of lowercase letters."""
    return [
        1.0 if prompt == "Say z:" else sum(c in string.ascii_lowercase for c in completion) / max(len(completion), 1)
        for prompt, completion in zip(prompts, completions)
    ]


def test_dynamic_sampling_one_step_off_replaces_groups_without_signal_at_the_step_that_trains_them(
        tiny_model_dir, reward_plugin, write_jsonl, fast_trainer):
    """k = 1: the batch sampled at step n is trained at step n + 1, where its groups without signal are
    replaced by the prompts the data loader gives next, sampled then with the current weights."""
    from test_module import make_data, make_module

    reward_plugin(gated=gated)
    pl.seed_everything(0)
    rows = [{"prompt": p} for p in ["Say z:", "Say a:", "Say b:", "Say c:", "Say z:", "Say d:", "Say e:", "Say f:",
                                     "Say g:", "Say h:"]]
    module = make_module(tiny_model_dir, rewards=[{"name": "gated"}], dynamic_sampling=True, max_staleness=1)
    started, start = [], module.rollout_pipeline.start

    def recording_start(module_, item, in_step=False):
        started.append(item.batch.prompts)
        start(module_, item, in_step)

    module.rollout_pipeline.start = recording_start
    trained, metrics = fit_recording(module, make_data(write_jsonl(rows), batch_size=2, shuffle=False), fast_trainer(max_steps=2))
    # step 0 samples [z, a] (the pipeline fills); step 1 samples [b, c], then trains [z, a]: z has no
    # signal, the next batch of the loader, [z, d], is sampled now and gives d
    assert trained[0] is None and trained[1].prompts == ["Say a:", "Say d:"]
    assert metrics[1]["dynamic_sampling/rounds"] == 2
    # the extra round starts before step 1's own batch: its scoring waits behind no job of [b, c]
    assert started[:3] == [["Say z:", "Say a:"], ["Say z:", "Say d:"], ["Say b:", "Say c:"]]
    assert metrics[1]["dynamic_sampling/dropped_frac"] == pytest.approx(2 / 4)
    # the extra round was sampled by the current weights (version 0 still: no optimizer step yet), and
    # its behaviour log-probs join the batch's: sampled and trained by the same weights, ratio 1
    assert trained[1].rollout.weight_versions.tolist() == [0] * 8
    assert trained[1].rollout.sampling_logps is not None
    assert metrics[1]["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    # step 2 samples [e, f] (after what step 1 drew) and trains [b, c], which needs no extra round
    assert trained[2].prompts == ["Say b:", "Say c:"]
    assert metrics[2]["dynamic_sampling/rounds"] == 1 and metrics[2]["async/staleness_max"] == 1.0
    assert [batch["prompts"] for batch in module.rollout_pipeline.state_dict()["per_rank"][0]] == [["Say e:", "Say f:"]]


GATED_REWARD = '''
import string


def gated(prompts, completions, **kwargs):
    """0.5 for every third prompt of DYNAMIC_PROMPTS (a group without signal), else the lowercase fraction."""
    return [0.5 if prompt.endswith("!:") else sum(c in string.ascii_lowercase for c in completion) / max(len(completion), 1)
            for prompt, completion in zip(prompts, completions)]
'''
# 12 prompts (6 batches of 2 per epoch), every third without signal under GATED_REWARD
DYNAMIC_PROMPTS = [{"prompt": f"Say {string.ascii_letters[i:i + 8]}{'!' if i % 3 == 0 else ''}:"} for i in range(12)]


def killed_twice_and_resumed(config: dict, tmp_path: Path, threads: int | None = None) -> tuple[Path, Path]:
    """``config`` uninterrupted (beside), and killed after the checkpoints of steps 2 and 4, each time
    resumed with ``--ckpt_path last``: the two run directories (uninterrupted, interrupted)."""
    reference, directory = tmp_path / "reference", tmp_path / "interrupted"
    reference.mkdir()
    directory.mkdir()
    with ThreadPoolExecutor(1) as beside:
        uninterrupted = beside.submit(lit_grpo_fit, reference, config, threads=threads)
        for step, args in ((2, ()), (4, ("--ckpt_path", "last"))):
            killed = lit_grpo_fit(directory, killed_during_step_after(config, step), *args, threads=threads)
            assert killed.returncode == -signal.SIGKILL, killed.stderr[-5000:]
            assert checkpoint_at(directory)["global_step"] == step
        resumed = lit_grpo_fit(directory, config, "--ckpt_path", "last", threads=threads)
        assert resumed.returncode == 0, resumed.stderr[-5000:]
        finished = uninterrupted.result()
    assert finished.returncode == 0, finished.stderr[-5000:]
    return reference, directory


def assert_same_run(reference: Path, directory: Path) -> tuple[dict, Counter]:
    """Every step logged once with the reference's values, the same prompts trained as often: the
    reference's logged scalars, and how many completions of each prompt it trained."""
    expected = logged_scalars(reference / "runs/resume/version_0")
    logged = logged_scalars(directory / "runs/resume/version_0")
    assert sorted(logged["reward"]) == sorted(expected["reward"]) == [1, 2, 3, 4, 5, 6]
    for tag, values in expected.items():
        assert logged[tag] == values, tag
    as_key = lambda prompt: json.dumps(prompt, sort_keys=True)
    trained = Counter(map(as_key, trained_prompts(reference)))
    assert Counter(map(as_key, trained_prompts(directory))) == trained
    return expected, trained


def test_killed_one_step_off_dynamic_sampling_run_resumes_exactly(tiny_model_dir, tmp_path):
    reward_file = tmp_path / "gated_reward.py"
    reward_file.write_text(GATED_REWARD)
    config = async_config(tiny_model_dir, tmp_path, max_staleness=1, dynamic_sampling=True,
                          rewards=[{"name": f"{reward_file}:gated"}])
    data_file = tmp_path / "dynamic.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in DYNAMIC_PROMPTS))
    config["data"]["data_files"] = str(data_file)
    reference, directory = killed_twice_and_resumed(config, tmp_path)
    logged, _ = assert_same_run(reference, directory)
    rounds = logged["dynamic_sampling/rounds"]
    assert max(rounds.values()) == 2  # extra rounds happened, and were counted
    assert sum(value > 0 for value in logged["dynamic_sampling/dropped_frac"].values()) >= 2
    # an extra round's groups were sampled by the weights of their step: fresher than the batch they join
    extra = [step for step, value in rounds.items() if value == 2 and step > 1]
    assert extra and all(logged["async/staleness_mean"][step] < logged["async/staleness_max"][step] == 1.0 for step in extra)


def test_killed_one_step_off_tools_run_resumes_with_no_prompt_lost_or_trained_twice(warm_tool_model, tmp_path):
    """The example environment's lookup tool, called by the warm-started tiny model: killed with
    multi-turn batches in flight (each checkpoint holds one, sampled and scored, with its
    conversations), resumed, it logs and trains what the uninterrupted run does."""
    rows = [json.loads(line) for line in (REPO / "configs/data/kv_lookup.jsonl").read_text().splitlines()[:6]]
    data_file = tmp_path / "kv.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = fit_config(warm_tool_model, data_file)
    config["trainer"]["max_steps"] = 6
    config["model"].update(max_completion_length=96, rewards=[{"name": "kv_answer"}], environment={"name": "kv_lookup"},
                           max_tool_calling_iterations=2, steps_per_generation=1, max_staleness=1,
                           log_completions_every_n_steps=1, num_completions_to_log=100)
    config["data"]["conversational"] = True
    config["optimizer"]["init_args"]["lr"] = 3e-4
    reference, directory = killed_twice_and_resumed(config, tmp_path, threads=1)  # one thread: test_resume's reason
    logged, trained = assert_same_run(reference, directory)
    # 2 epochs of the 6 rows (the first batch of the second filled the pipeline of the first), 4 completions
    # each (their questions repeat: the stores, in other columns, differ)
    assert sum(trained.values()) == 2 * 6 * 4
    assert min(logged["tools/calls_per_rollout"].values()) > 0.3  # the rollouts really are multi-turn
    assert set(logged["async/staleness_max"].values()) == {0.0, 1.0}
    saved = checkpoint_at(directory)["callbacks"]["RolloutPipeline"]["per_rank"][0]
    assert [len(batch["rollout"]["conversations"]) for batch in saved] == [2 * 4]


def test_on_servers_a_multi_turn_batch_is_sampled_in_the_step_and_only_scored_in_the_background():
    """``vllm_server`` samples single-turn batches in the background thread; a multi-turn one is sampled
    in the step (its turns' seeds come from the trainer's random state), then scored in the background."""
    from types import SimpleNamespace

    from lit_grpo.data import PromptBatch
    from lit_grpo.rollout.async_pipeline import InFlight, RolloutPipeline
    from lit_grpo.rollout.records import Rollout

    calls = []
    ones = torch.ones(2, 3, dtype=torch.long)
    sampled = Rollout(ones, ones, ones, ones, torch.zeros(2, dtype=torch.bool), sampling_logps=torch.full((2, 3), -1.0),
                      tool_mask=ones, conversations=[], weight_versions=torch.tensor([4, 4]))

    def generate(prompts, columns):
        calls.append(("generate in the step", threading.current_thread().name))
        return sampled

    def score(scorer, batch, rollout, k, device):
        calls.append(("score", threading.current_thread().name))
        return ["done"] * 2, torch.zeros(2, 1)

    collector = SimpleNamespace(tool_use=object(), background_sampler=lambda batch: calls.append("background sampler"),
                                score=score, scorer=SimpleNamespace(last_error_counts={}), settings=SimpleNamespace(num_generations=2))
    module = SimpleNamespace(engine=SimpleNamespace(samples_elsewhere=True), collector=collector, generate=generate)
    pipeline = RolloutPipeline(max_staleness=1, optimizer_steps_per_batch=1)
    item = InFlight(PromptBatch(["once 1"], {}), {"generate": 0.0})
    pipeline.start(module, item)
    item.finish()
    pipeline.teardown(None, None, "fit")
    assert [call[0] for call in calls] == ["generate in the step", "score"]
    assert calls[0][1] == "MainThread" and calls[1][1].startswith("lit-grpo-scoring")
    assert item.rollout.weight_versions.tolist() == [4, 4] and item.completions == ["done"] * 2 and item.failure is None
    collector.tool_use = None  # single-turn: the servers sample in the background, as before
    calls.clear()
    pipeline.start(module, InFlight(PromptBatch(["once 1"], {}), {"generate": 0.0}))
    pipeline.teardown(None, None, "fit")
    assert calls[0] == "background sampler"


def test_rounds_with_and_without_behaviour_log_probs_are_not_concatenated():
    """A round without ``sampling_logps`` joining one with them would leave the whole batch uncorrected:
    refused (an async extra round always carries them)."""
    from lit_grpo.rollout.records import Rollout, concat_rollouts

    ones = torch.ones(1, 2, dtype=torch.long)
    with_logps = Rollout(ones, ones, ones, ones, torch.zeros(1, dtype=torch.bool), sampling_logps=torch.full((1, 2), -1.0))
    without = Rollout(ones, ones, ones, ones, torch.zeros(1, dtype=torch.bool))
    assert concat_rollouts([with_logps, with_logps], pad_token_id=0).sampling_logps.tolist() == [[-1.0, -1.0]] * 2
    assert concat_rollouts([without, without], pad_token_id=0).sampling_logps is None
    with pytest.raises(ValueError, match="some rollouts have sampling_logps and others not"):
        concat_rollouts([with_logps, without], pad_token_id=0)


# ----------------------------------------------------------------------------------------------
# Tool calls in flight
# ----------------------------------------------------------------------------------------------


def test_tool_calls_run_at_most_the_bound_at_once_each_timed_from_its_own_start(monkeypatch):
    """With a bound of 2, five 0.2 s calls run two at a time (never three threads at once), and each
    finishes within a 0.35 s timeout though the last starts ~0.4 s after the first."""
    import time

    from lit_grpo.rollout.tools import calls as tool_calls

    monkeypatch.setattr(tool_calls, "MAX_CONCURRENT_TOOL_CALLS", 2)
    lock, active, most = threading.Lock(), [0], [0]

    def nap(x: int) -> int:
        """Sleep a little and return x.

        Args:
            x: a number
        """
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        return x

    tools = {"nap": tool_calls.make_tool(nap, "t")}
    results = tool_calls.run_tool_calls([(tool_calls.ToolCall("nap", {"x": i}), tools) for i in range(5)], timeout=0.35)
    assert [(r.content, r.failed) for r in results] == [(str(i), False) for i in range(5)]
    assert most[0] == 2
