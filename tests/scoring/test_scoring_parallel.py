"""RewardScorer: worker pools (num_workers), async rewards, per-call timeouts and on_error."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import pickle
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

import lit_grpo
from lit_grpo import plugins
from lit_grpo.scoring import RewardError, RewardScorer, RewardSpec

if str(Path(__file__).parents[1]) not in sys.path:  # e.g. under --import-mode=importlib
    sys.path.insert(0, str(Path(__file__).parents[1]))

import parallel_rewards as pr  # noqa: E402  (module level, so worker processes can unpickle them)

PLUGIN = "parallel_test_rewards"
REWARDS = {
    "slow_len": pr.slow_len,
    "scaled_len": pr.scaled_len,
    "echo_level": pr.echo_level,
    "hangs_on_hang": pr.hangs_on_hang,
    "fails_on_bad": pr.fails_on_bad,
    "dies_on_die": pr.dies_on_die,
    "worker_pid": pr.worker_pid,
    "two_values": pr.two_values,
    "unloadable_for_bad": pr.unloadable_for_bad,
    "async_sleepy": pr.async_sleepy,
    "async_sleepy_too": pr.async_sleepy,
    "async_hangs_on_hang": pr.async_hangs_on_hang,
    "async_fails_on_bad": pr.async_fails_on_bad,
    "async_length": pr.AsyncLength,
    "trl_math_accuracy": pr.trl_math_accuracy,
    "process_id": pr.process_id,
    "thread_safe_process_id": pr.thread_safe_process_id,
}


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    monkeypatch.delenv("LIT_GRPO_STRICT_PLUGINS", raising=False)
    plugins.reset_plugins()
    module = types.ModuleType(PLUGIN)

    @lit_grpo.hookimpl
    def register_rewards(register):
        for name, obj in REWARDS.items():
            register(obj, name=name)

    module.register_rewards = register_rewards
    plugins.register_plugin(module)
    yield
    plugins.reset_plugins()


@pytest.fixture
def make_scorer():
    """``make_scorer(*specs) -> RewardScorer``, closed (worker processes stopped) after the test."""
    scorers = []

    def make(*specs):
        scorer = RewardScorer(list(specs))
        scorers.append(scorer)
        return scorer

    yield make
    for scorer in scorers:
        scorer.close()


def call(scorer, completions, columns=None):
    n = len(completions)
    return scorer([f"p{i}" for i in range(n)], list(completions), [[i] for i in range(n)], columns or {})


def column(out, k=0):
    return [None if math.isnan(v) else v for v in out[:, k].tolist()]


# --------------------------------------------------------------------------------------------------
# Worker pools
# --------------------------------------------------------------------------------------------------


def test_pool_scores_samples_in_parallel(make_scorer):
    scorer = make_scorer(RewardSpec("slow_len", num_workers=4))
    assert scorer.modes == ["pool"]
    call(scorer, ["w"] * 4)  # start the workers; their start-up is not what is measured
    completions = ["a" * (i + 1) for i in range(8)]
    start = time.perf_counter()
    out = call(scorer, completions)
    elapsed = time.perf_counter() - start
    serial = pr.SLOW_SECONDS * len(completions)
    assert out[:, 0].tolist() == [float(i + 1) for i in range(8)]
    assert elapsed < 0.6 * serial, f"{elapsed:.2f} s for 8 samples on 4 workers; serial takes {serial:.2f} s"
    assert scorer.last_error_counts == {"slow_len": 0}


def test_a_worker_process_imports_no_torch():
    """A worker imports lit_grpo.scoring.pool: the package's __init__ must not import the scorer (torch)."""
    code = "import sys, lit_grpo.scoring.pool; print(sorted({'torch', 'lit_grpo.scoring.scorer'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_pool_workers_are_kept_between_calls_and_restart_after_close(make_scorer):
    scorer = make_scorer(RewardSpec("worker_pid", num_workers=2))
    first = set(call(scorer, ["a", "b", "c", "d"])[:, 0].tolist())
    second = set(call(scorer, ["a", "b", "c", "d"])[:, 0].tolist())
    # the 2 workers serve both calls (the pool starts its second worker on demand, so the first call
    # may see one pid and the second two): never more than 2 distinct processes
    assert len(first | second) <= 2
    scorer.close()
    third = set(call(scorer, ["a", "b"])[:, 0].tolist())
    assert third.isdisjoint(first | second)


def test_pool_calls_get_one_sample_of_every_argument(make_scorer):
    scorer = make_scorer(RewardSpec("echo_level", num_workers=2), RewardSpec("scaled_len", num_workers=1, args={"scale": 2.0}))
    completions = [f"c{i}" for i in range(5)]
    out = call(scorer, completions, {"level": [10, 11, 12, 13, 14]})
    assert out[:, 0].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert out[:, 1].tolist() == [4.0] * 5  # bound args (a pickled functools.partial) reach the worker


def test_async_reward_with_num_workers_runs_in_the_pool(make_scorer):
    scorer = make_scorer(RewardSpec("async_length", num_workers=1, timeout=5, args={"scale": 3.0}))
    assert scorer.modes == ["pool"]
    assert call(scorer, ["a", "bb"])[:, 0].tolist() == [3.0, 6.0]


@pytest.mark.parametrize("on_error, fill", [("none", None), ("zero", 0.0)])
def test_timeout_fails_exactly_the_hanging_samples(make_scorer, on_error, fill, caplog):
    timeout = 0.5
    scorer = make_scorer(RewardSpec("hangs_on_hang", num_workers=3, timeout=timeout, on_error=on_error))
    call(scorer, ["warm", "up", "now"])
    completions = ["ab", "hang 1", "abcd", "hang 2", "a", "abc"]
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="lit_grpo.scoring"):
        out = call(scorer, completions)
    elapsed = time.perf_counter() - start
    assert column(out) == [2.0, fill, 4.0, fill, 1.0, 3.0]
    assert scorer.last_error_counts == {"hangs_on_hang": 2}
    assert elapsed < timeout + 3
    (record,) = caplog.records
    assert "Reward 'hangs_on_hang'" in record.message and "failed on 2 of 6 samples (2 TimeoutError)" in record.message
    assert "sample 1: TimeoutError: no result within the 0.5 s timeout" in record.message
    # The killed workers are replaced: the next call scores everything and counts no errors.
    assert column(call(scorer, ["x", "yy"])) == [1.0, 2.0]
    assert scorer.last_error_counts == {"hangs_on_hang": 0}


def test_timeout_with_raise_stops_promptly(make_scorer):
    scorer = make_scorer(RewardSpec("hangs_on_hang", num_workers=2, timeout=0.5))
    start = time.perf_counter()
    with pytest.raises(RewardError) as excinfo:
        call(scorer, ["ok", "hang here", "fine"])
    assert time.perf_counter() - start < 10  # worker start-up included
    message = str(excinfo.value)
    assert message.startswith(f"Reward 'hangs_on_hang' ({PLUGIN}) timed out after 0.5 s\n")
    assert "while scoring sample 1 of 3 in a worker process (num_workers=2)" in message
    assert "completion: 'hang here'" in message
    assert "model.rewards[0].on_error" in message


def test_worker_exception_with_raise_names_reward_sample_and_traceback(make_scorer):
    scorer = make_scorer(RewardSpec("fails_on_bad", num_workers=2))
    with pytest.raises(RewardError) as excinfo:
        scorer(["q0", "q1", "q2"], ["good", "bad one", "fine"], [[], [], []], {})
    message = str(excinfo.value)
    assert message.startswith(f"Reward 'fails_on_bad' ({PLUGIN}) raised ValueError: cannot score 'bad one'\n")
    assert "while scoring sample 1 of 3 in a worker process" in message
    assert "prompt:     'q1'" in message and "completion: 'bad one'" in message
    traceback = message.split("  Traceback (most recent call last):\n", 1)[1].splitlines()[:-1]
    assert len(traceback) == 3 and "parallel_rewards.py" in traceback[0] and traceback[0].endswith(", in fails_on_bad")
    assert traceback[1:] == ['      raise ValueError(f"cannot score {c!r}")', "  ValueError: cannot score 'bad one'"]
    assert "lit_grpo" not in message  # the worker's own frames are left out
    assert message.splitlines()[-1].startswith("To keep training, set model.rewards[0].on_error: none (or zero)")


def test_worker_exception_with_zero_scores_only_that_sample(make_scorer, caplog):
    scorer = make_scorer(RewardSpec("fails_on_bad", num_workers=2, on_error="zero"))
    with caplog.at_level(logging.WARNING, logger="lit_grpo.scoring"):
        out = call(scorer, ["good", "bad one", "fine", "bad two"])
    assert column(out) == [1.0, 0.0, 1.0, 0.0]
    assert scorer.last_error_counts == {"fails_on_bad": 2}
    (record,) = caplog.records
    assert "failed on 2 of 4 samples (2 ValueError); they score 0.0 (on_error: zero)" in record.message
    assert "Traceback (most recent call last):" in record.message  # the worker's, the first time


@pytest.mark.parametrize("on_error", ["raise", "none"])
def test_worker_that_dies_fails_its_sample_and_the_pool_recovers(make_scorer, on_error):
    scorer = make_scorer(RewardSpec("dies_on_die", num_workers=2, on_error=on_error))
    completions = ["a", "b", "die now", "c"]
    if on_error == "raise":
        with pytest.raises(RewardError, match=r"(?s)'dies_on_die' .*failed: the worker process exited with code 1 "
                                              r"while scoring this sample\n  while scoring sample 2 of 4"):
            call(scorer, completions)
    else:
        assert column(call(scorer, completions)) == [1.0, 1.0, None, 1.0]
        assert scorer.last_error_counts == {"dies_on_die": 1}
    assert column(call(scorer, ["x", "y", "z"])) == [1.0, 1.0, 1.0]
    assert scorer.last_error_counts == {"dies_on_die": 0}


def test_bad_return_value_in_a_worker_is_an_error_whatever_on_error(make_scorer):
    scorer = make_scorer(RewardSpec("two_values", num_workers=1, on_error="zero"))
    with pytest.raises(RewardError, match=r"'two_values' .* returned 2 values when called with sample 0 alone; expected 1"):
        call(scorer, ["a", "b"])


def test_result_the_trainer_cannot_unpickle_fails_that_sample(make_scorer):
    scorer = make_scorer(RewardSpec("unloadable_for_bad", num_workers=1, on_error="none"))
    assert column(call(scorer, ["ok", "bad", "fine"])) == [1.0, None, 1.0]
    assert scorer.last_error_counts == {"unloadable_for_bad": 1}


def test_reward_that_cannot_be_pickled_is_rejected_at_construction(monkeypatch):
    def local(completions, **kwargs):
        return [0.0] * len(completions)

    module = types.ModuleType("local_rewards")

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(local)

    module.register_rewards = register_rewards
    plugins.register_plugin(module)
    with pytest.raises(ValueError, match=r"model\.rewards\[1\]\.num_workers \('local'\): Reward 'local' .*cannot be pickled"):
        RewardScorer([RewardSpec("slow_len"), RewardSpec("local", num_workers=2)])
    assert RewardScorer([RewardSpec("local")]).modes == ["local"]  # fine in-process


def test_reward_a_worker_cannot_import_is_a_reward_error(make_scorer, monkeypatch):
    # Picklable here (by reference to a module that only this process has), not loadable in a worker.
    module = types.ModuleType("only_in_the_trainer")
    exec("def ghost(completions, **kwargs):\n    return [1.0] * len(completions)\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "only_in_the_trainer", module)

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(module.ghost)

    plugin = types.ModuleType("ghost_plugin")
    plugin.register_rewards = register_rewards
    plugins.register_plugin(plugin)
    scorer = make_scorer(RewardSpec("ghost", num_workers=1, on_error="zero"))
    with pytest.raises(RewardError, match=r"(?s)Reward 'ghost' .*could not be loaded in a worker process.*No module named 'only_in_the_trainer'"):
        call(scorer, ["a"])


def test_pickled_or_copied_scorer_leaves_its_workers_behind(make_scorer):
    scorer = make_scorer(RewardSpec("worker_pid", num_workers=1), RewardSpec("async_length", args={"scale": 2.0}))
    pid = call(scorer, ["a"])[0, 0].item()
    clone = pickle.loads(pickle.dumps(scorer))
    twin = copy.deepcopy(scorer)
    try:
        assert clone._pools == {} and clone._loop is None
        assert clone.names == scorer.names and torch.equal(clone.weights, scorer.weights)
        assert call(clone, ["a", "bb"])[:, 1].tolist() == [2.0, 4.0]
        assert call(clone, ["a"])[0, 0].item() != pid
        assert call(twin, ["a"])[0, 0].item() != pid
        assert call(scorer, ["a"])[0, 0].item() == pid  # the original's pool is untouched
    finally:
        clone.close()
        twin.close()


# --------------------------------------------------------------------------------------------------
# Async rewards
# --------------------------------------------------------------------------------------------------


def test_async_rewards_are_awaited_concurrently(make_scorer):
    scorer = make_scorer(RewardSpec("async_sleepy"), RewardSpec("async_sleepy_too", weight=2.0))
    assert scorer.modes == ["async", "async"]
    start = time.perf_counter()
    out = call(scorer, ["a", "bb", "ccc"])
    elapsed = time.perf_counter() - start
    assert out.tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert elapsed < 0.9, f"two 0.5 s async rewards took {elapsed:.2f} s"


def test_async_class_reward_uses_one_loop_across_calls(make_scorer):
    scorer = make_scorer(RewardSpec("async_length", args={"scale": 0.5}))
    assert scorer.modes == ["async"]
    assert call(scorer, ["ab"]).tolist() == [[1.0]]
    assert call(scorer, ["abcd"]).tolist() == [[2.0]]
    assert len(scorer.rewards[0].loops) == 1


def test_async_reward_runs_even_when_the_caller_has_a_running_loop(make_scorer):
    import asyncio

    scorer = make_scorer(RewardSpec("async_length"))

    async def inside():
        return call(scorer, ["abc"])

    assert asyncio.run(inside()).tolist() == [[3.0]]


@pytest.mark.parametrize("on_error, fill", [("none", None), ("zero", 0.0)])
def test_async_timeout_fails_exactly_the_hanging_samples(make_scorer, on_error, fill):
    timeout = 0.3
    scorer = make_scorer(RewardSpec("async_hangs_on_hang", timeout=timeout, on_error=on_error))
    start = time.perf_counter()
    out = call(scorer, ["ab", "hang", "abc", "hang too"])
    elapsed = time.perf_counter() - start
    assert column(out) == [2.0, fill, 3.0, fill]
    assert scorer.last_error_counts == {"async_hangs_on_hang": 2}
    assert elapsed < 2 * timeout + 1  # the batch call, then one concurrent retry per sample


def test_async_timeout_with_raise(make_scorer):
    scorer = make_scorer(RewardSpec("async_hangs_on_hang", timeout=0.3))
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"^Reward 'async_hangs_on_hang' .* timed out after 0\.3 s\n  while scoring sample 1 "
                                          r"of 2 \(found by calling the reward again with each sample alone\)\n.*\n  completion: 'hang'"):
        call(scorer, ["ab", "hang"])
    assert time.perf_counter() - start < 1.5  # the batch call, then one concurrent call per sample


def test_async_exception_follows_on_error(make_scorer):
    scorer = make_scorer(RewardSpec("async_fails_on_bad", on_error="none"))
    assert column(call(scorer, ["ok", "bad", "fine"])) == [1.0, None, 1.0]
    assert scorer.last_error_counts == {"async_fails_on_bad": 1}
    raising = make_scorer(RewardSpec("async_fails_on_bad"))
    with pytest.raises(RewardError, match=r"^Reward 'async_fails_on_bad' .* raised ValueError: cannot score 'bad'") as excinfo:
        call(raising, ["ok", "bad"])
    assert isinstance(excinfo.value.__cause__, ValueError)


# --------------------------------------------------------------------------------------------------
# Everything at once
# --------------------------------------------------------------------------------------------------


def test_pool_async_and_in_process_rewards_in_one_call(make_scorer):
    scorer = make_scorer(
        RewardSpec("scaled_len", args={"scale": 10.0}),
        RewardSpec("slow_len", num_workers=2),
        RewardSpec("async_sleepy"),
        RewardSpec("fails_on_bad", on_error="none"),
    )
    assert scorer.modes == ["local", "pool", "async", "local"]
    out = call(scorer, ["a", "bad", "ccc", "dd"])
    assert out[:, 0].tolist() == [10.0, 30.0, 30.0, 20.0]
    assert out[:, 1].tolist() == [1.0, 3.0, 3.0, 2.0]
    assert out[:, 2].tolist() == [1.0, 3.0, 3.0, 2.0]
    assert column(out, 3) == [1.0, None, 1.0, 1.0]
    assert scorer.last_error_counts == {"scaled_len": 0, "slow_len": 0, "async_sleepy": 0, "fails_on_bad": 1}


def test_in_process_error_stops_the_pool_and_is_raised(make_scorer):
    scorer = make_scorer(RewardSpec("hangs_on_hang", num_workers=1), RewardSpec("fails_on_bad"))
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"^Reward 'fails_on_bad' .* raised ValueError"):
        call(scorer, ["hang", "bad"])
    assert time.perf_counter() - start < 5  # the hanging pool sample was abandoned, not awaited
    assert call(scorer, ["ok"]).tolist() == [[2.0, 1.0]]



def test_when_pool_and_async_rewards_both_fail_the_first_configured_is_raised_and_no_thread_is_left(make_scorer):
    for first, second in (("async_fails_on_bad", "fails_on_bad"), ("fails_on_bad", "async_fails_on_bad")):
        scorer = make_scorer(RewardSpec(first, num_workers=int(first == "fails_on_bad")),
                             RewardSpec(second, num_workers=int(second == "fails_on_bad")))
        with pytest.raises(RewardError, match=rf"^Reward '{first}' .* raised ValueError: cannot score 'bad'"):
            call(scorer, ["ok", "bad"])
        assert [t.name for t in threading.enumerate() if t.name.startswith("lit-grpo-reward")] == []


# --------------------------------------------------------------------------------------------------
# Off the main thread (the asynchronous pipeline's scoring thread, model.max_staleness > 0)
# --------------------------------------------------------------------------------------------------


def call_in_a_thread(scorer, completions, columns=None, limit=60.0):
    """``call`` from a thread other than the main one, as the asynchronous pipeline scores; fails if
    it has not returned within ``limit`` seconds (the thread is a daemon: a hung test still ends)."""
    outcome = {}

    def score():
        try:
            outcome["scores"] = call(scorer, completions, columns)
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            outcome["error"] = exc

    thread = threading.Thread(target=score, name="lit-grpo-scoring", daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"scoring off the main thread did not return within {limit:g} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["scores"]


def test_math_verify_reward_with_its_default_timeouts_scores_the_same_off_the_main_thread(make_scorer):
    """A TRL-style reward (math_verify.parse / verify with their signal.alarm timeouts) gives off the
    main thread the rewards it gives on it, without Math-Verify's "threaded environment" error."""
    scorer = make_scorer(RewardSpec("trl_math_accuracy"))
    completions = ["The answer is $\\frac{1}{2}$.", "$0.5$", "So $\\boxed{3}$.", "$4$"]
    columns = {"solution": ["$\\frac12$", "$\\frac12$", "$3$", "$3$"]}
    on_main = call(scorer, completions, columns)
    assert column(on_main) == [1.0, 1.0, 1.0, 0.0]
    assert column(call_in_a_thread(scorer, completions, columns)) == column(on_main)


def test_math_accuracy_off_the_main_thread_keeps_its_timeout(make_scorer):
    """An answer Math-Verify would compare for ever ((9^9)!, a number of 3 billion digits) is cut off
    after timeout_seconds off the main thread too, as on it."""
    scorer = make_scorer(RewardSpec("math_accuracy", args={"timeout_seconds": 1}))
    completions = ["The answer is $(9^{9})!$.", "The answer is 72."]
    start = time.perf_counter()
    scores = call_in_a_thread(scorer, completions, {"answer": ["72", "72"]}, limit=30)
    assert column(scores) == [0.0, 1.0]
    assert time.perf_counter() - start < 20  # 1 s per Math-Verify call, and the worker's start


def test_in_process_rewards_off_the_main_thread_run_in_one_process_of_their_own(make_scorer):
    scorer = make_scorer(RewardSpec("process_id"), RewardSpec("thread_safe_process_id"), RewardSpec("scaled_len"))
    assert call(scorer, ["a"]).tolist() == [[os.getpid(), os.getpid(), 1.0]]  # on the main thread: here
    first = call_in_a_thread(scorer, ["a", "bb"])
    worker = first[0, 0].item()
    assert worker != os.getpid() and first[:, 0].tolist() == [worker, worker]
    assert first[:, 1].tolist() == [os.getpid()] * 2  # thread_safe = True: it stays in the thread
    assert first[:, 2].tolist() == [1.0, 2.0]
    assert call_in_a_thread(scorer, ["ccc"])[0, 0].item() == worker  # started once, reused
    assert call(scorer, ["a"])[0, 0].item() == os.getpid()


def test_first_party_rewards_that_use_no_signals_stay_in_the_scoring_thread(make_scorer):
    scorer = make_scorer(RewardSpec("char_fraction", args={"chars": "a"}), RewardSpec("think_format"),
                         RewardSpec("numeric_accuracy"), RewardSpec("math_accuracy"))
    scores = call_in_a_thread(scorer, ["<think>a</think><answer>72</answer>"], {"answer": ["72"]})
    assert scores[0, 2:].tolist() == [1.0, 1.0]
    assert sorted(scorer._own_processes.pools) == [2, 3]  # only the Math-Verify rewards got a process of their own


def test_in_process_reward_errors_off_the_main_thread_follow_on_error(make_scorer):
    scorer = make_scorer(RewardSpec("fails_on_bad", on_error="zero"))
    assert call_in_a_thread(scorer, ["a", "bad", "c"]).tolist() == [[1.0], [0.0], [1.0]]
    assert scorer.last_error_counts == {"fails_on_bad": 1}
    strict = make_scorer(RewardSpec("fails_on_bad"))
    with pytest.raises(RewardError, match=r"(?s)^Reward 'fails_on_bad' .* raised ValueError: cannot score 'bad'.*"
                                          r"while scoring sample 1 of 3 \(found by calling the reward again"):
        call_in_a_thread(strict, ["a", "bad", "c"])


def test_in_process_reward_whose_process_dies_off_the_main_thread_fails_only_that_sample(make_scorer):
    scorer = make_scorer(RewardSpec("dies_on_die", on_error="none"))
    assert column(call_in_a_thread(scorer, ["a", "die", "c"])) == [1.0, None, 1.0]
    assert scorer.last_error_counts == {"dies_on_die": 1}
    assert column(call_in_a_thread(scorer, ["a"])) == [1.0]  # a new worker process took its place


def test_batch_that_cannot_be_pickled_is_scored_in_the_thread_with_one_warning(make_scorer, caplog):
    scorer = make_scorer(RewardSpec("echo_level"))
    unpicklable = [1.0, 2.0]

    class Level(float):  # a value of a local class: it cannot be pickled
        pass

    with caplog.at_level(logging.WARNING, logger="lit_grpo.scoring.scorer"):
        scores = call_in_a_thread(scorer, ["c0", "c1"], {"level": [Level(v) for v in unpicklable]})
    assert column(scores) == unpicklable
    (warning,) = [r.getMessage() for r in caplog.records if "scoring thread" in r.getMessage()]
    assert "the arguments of its batch cannot be pickled" in warning


def test_reward_that_cannot_be_pickled_stays_in_the_scoring_thread_with_one_warning(monkeypatch, caplog):
    threshold = 2

    def longer_than(completions, **kwargs):  # a closure: it cannot be pickled
        return [float(len(c) > threshold) for c in completions]

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(longer_than)

    module = types.ModuleType("closure_rewards")
    module.register_rewards = register_rewards
    plugins.register_plugin(module)
    scorer = RewardScorer([RewardSpec("longer_than")])
    try:
        with caplog.at_level(logging.WARNING, logger="lit_grpo.scoring.scorer"):
            assert call_in_a_thread(scorer, ["a", "abc"]).tolist() == [[0.0], [1.0]]
            assert call_in_a_thread(scorer, ["abcd"]).tolist() == [[1.0]]
        warnings = [r.getMessage() for r in caplog.records if "scoring thread" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "Reward 'longer_than'" in warnings[0] and "cannot be pickled" in warnings[0]
    finally:
        scorer.close()


def test_reward_loaded_from_a_file_runs_in_worker_processes(make_scorer, tmp_path, monkeypatch, caplog):
    """path/to/file.py:function rewards load in worker processes (num_workers, and off the main thread)."""
    (tmp_path / "my_rewards.py").write_text(
        "import os\n\ndef where(completions, **kwargs):\n    return [float(os.getpid())] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    pool = make_scorer(RewardSpec("my_rewards.py:where", num_workers=1))
    assert call(pool, ["a"])[0, 0].item() not in (os.getpid(), 0.0)
    in_process = make_scorer(RewardSpec("my_rewards.py:where"))
    assert call_in_a_thread(in_process, ["a"])[0, 0].item() not in (os.getpid(), 0.0)
    assert not [record for record in caplog.records if "scoring thread" in record.getMessage()]


TRL_STYLE_REWARD = """
from math_verify import parse, verify


def accuracy_reward(completions, target, **kwargs):
    # TRL's accuracy_reward as users copy it: Math-Verify's parse and verify with their default
    # timeouts; None where the completion holds no expression
    rewards = []
    for content, gold in zip(completions, target):
        answer_parsed = parse(content)
        rewards.append(float(verify(parse(f"${gold}$"), answer_parsed)) if answer_parsed else None)
    return rewards
"""


def test_one_step_off_quickstart_with_a_math_verify_reward_scores_as_in_the_main_thread(tiny_model_dir, tmp_path):
    """configs/quickstart.yaml, 3 optimizer steps at model.max_staleness 1 (rewards scored in the
    pipeline's thread), with a TRL-style reward loaded from a file beside the config: it runs, and every
    trained completion has the rewards that scoring it in the main thread, as the synchronous run does,
    gives (whose first step trains the same completions: test_async_rollouts)."""
    import yaml
    from test_resume import REPO, lit_grpo_fit

    (tmp_path / "trl_rewards.py").write_text(TRL_STYLE_REWARD)
    config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    config["trainer"].update(max_steps=3, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
    config["model"].update(model_name_or_path=str(tiny_model_dir), max_staleness=1, log_completions_every_n_steps=1,
                           num_completions_to_log=100)
    config["model"]["rewards"].append({"name": "trl_rewards.py:accuracy_reward", "weight": 1.0})
    config["data"]["data_files"] = str(REPO / config["data"]["data_files"])
    finished = lit_grpo_fit(tmp_path, config)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "scoring thread" not in finished.stderr  # no reward fell back to the thread

    log = tmp_path / "runs/quickstart/version_0/completions.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [1, 2, 3] and len(rows) == 3 * 8 * 8  # 8 prompts x 8 each
    scorer = RewardScorer([{"name": "char_fraction"}, {"name": str(tmp_path / "trl_rewards.py") + ":accuracy_reward"}])
    try:
        targets = [row["prompt"].removeprefix("Say ").removesuffix(":") for row in rows]
        rescored = scorer([row["prompt"] for row in rows], [row["completion"] for row in rows], [[0]] * len(rows),
                          {"target": targets})
    finally:
        scorer.close()
    logged = torch.tensor([[math.nan if row["rewards"][name] is None else row["rewards"][name]
                            for name in ("char_fraction", "accuracy_reward")] for row in rows])
    torch.testing.assert_close(logged, rescored, equal_nan=True)
    parsed = ~logged[:, 1].isnan()  # where Math-Verify found an expression in the completion
    assert 0 < parsed.sum() < len(rows) and logged[:, 0].sum() > 0


class LinearScore:
    """A reward holding a torch module (as a reward model would, on a GPU): module-level, so it pickles."""

    def __init__(self):
        self.model = torch.nn.Linear(1, 1)
        self.calls = 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        return [float(len(c)) for c in completions]


def test_a_reward_holding_torch_state_stays_in_the_scoring_thread_with_one_warning(make_scorer, caplog):
    """Moved to a process of its own, a reward model would be copied there (a second copy on the GPU) and
    its state would drift from the trainer's: it is called in the thread, on this object, and says why."""
    reward = LinearScore()
    scorer = make_scorer(reward)
    with caplog.at_level(logging.WARNING, logger="lit_grpo.scoring.scorer"):
        assert call_in_a_thread(scorer, ["ab", "abc"]).tolist() == [[2.0], [3.0]]
        assert call_in_a_thread(scorer, ["a"]).tolist() == [[1.0]]
    assert reward.calls == 2 and scorer._own_processes.pools == {}  # called here, on this object
    (warning,) = [r.getMessage() for r in caplog.records if "scoring thread" in r.getMessage()]
    assert "holds torch tensors or modules" in warning
