"""Rewards for tests/scoring/test_scoring_parallel.py.

They live at the top level of an importable module (tests/ is on ``sys.path`` under pytest, and
worker processes inherit ``sys.path``) so that worker processes can unpickle them by reference.
"""

from __future__ import annotations

import asyncio
import os
import time

SLOW_SECONDS = 0.3


def slow_len(completions, **kwargs):
    """Sleeps SLOW_SECONDS per completion (a stand-in for CPU-bound work), then scores its length."""
    time.sleep(SLOW_SECONDS * len(completions))
    return [float(len(c)) for c in completions]


def scaled_len(completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]


def echo_level(completions, level, completion_ids, prompts, **kwargs):
    """Checks that every argument arrives sliced to the same samples, then returns the ``level`` column."""
    assert len(level) == len(completion_ids) == len(prompts) == len(completions)
    for p, c, ids in zip(prompts, completions, completion_ids):
        assert c == p.replace("p", "c") and ids == [int(c[1:])]
    return [float(v) for v in level]


def hangs_on_hang(completions, **kwargs):
    """Never returns (in test time) for a completion containing 'hang'."""
    if any("hang" in c for c in completions):
        time.sleep(120)
    return [float(len(c)) for c in completions]


def fails_on_bad(completions, **kwargs):
    for c in completions:
        if "bad" in c:
            raise ValueError(f"cannot score {c!r}")
    return [1.0] * len(completions)


def dies_on_die(completions, **kwargs):
    """Kills its own process for a completion containing 'die'."""
    if any("die" in c for c in completions):
        os._exit(1)
    return [1.0] * len(completions)


def worker_pid(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def two_values(completions, **kwargs):
    return [0.0, 0.0]


async def async_sleepy(completions, **kwargs):
    await asyncio.sleep(0.5)
    return [float(len(c)) for c in completions]


async def async_hangs_on_hang(completions, **kwargs):
    if any("hang" in c for c in completions):
        await asyncio.sleep(120)
    return [float(len(c)) for c in completions]


async def async_fails_on_bad(completions, **kwargs):
    await asyncio.sleep(0)
    for c in completions:
        if "bad" in c:
            raise ValueError(f"cannot score {c!r}")
    return [1.0] * len(completions)


class AsyncLength:
    """A class reward with ``async def __call__``; ``scale`` comes from YAML args."""

    def __init__(self, scale=1.0):
        self.scale = scale
        self.loops = set()

    async def __call__(self, completions, **kwargs):
        self.loops.add(id(asyncio.get_running_loop()))
        return [self.scale * len(c) for c in completions]


def _refuse_to_load():
    raise RuntimeError("this value cannot be loaded outside the worker")


class _Unloadable:
    def __reduce__(self):
        return (_refuse_to_load, ())


def unloadable_for_bad(completions, **kwargs):
    """Returns a value the trainer cannot unpickle for a completion containing 'bad'."""
    return [_Unloadable() if "bad" in c else 1.0 for c in completions]


def trl_math_accuracy(completions, solution, **kwargs):
    """TRL's and open-r1's accuracy reward: Math-Verify's parse and verify with their default timeouts
    (signal.alarm: they raise "doesn't support threaded environment" outside a main thread)."""
    from math_verify import parse, verify

    rewards = []
    for completion, gold in zip(completions, solution):
        content = completion if isinstance(completion, str) else completion[0]["content"]
        gold_parsed = parse(gold)
        rewards.append(float(verify(gold_parsed, parse(content))) if gold_parsed else None)
    return rewards


def process_id(completions, **kwargs):
    """The id of the process that scores (to tell where a reward ran)."""
    return [float(os.getpid())] * len(completions)


def thread_safe_process_id(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


thread_safe_process_id.thread_safe = True
