"""The three ways a reward of the scorer runs (used by :mod:`lit_grpo.scoring.scorer`, whose module doc
says when each is chosen), each giving one value per sample and the samples it failed on:

- :func:`score_in_process` (``num_workers: 0``): called once with the whole batch here (off the main
  thread, in a worker process of its own: :class:`~lit_grpo.scoring.own_process.OwnProcesses`);
- :func:`score_in_pool` (``num_workers > 0``): one sample per call in the reward's worker processes;
- :func:`score_async` (``async def``): awaited on the scorer's event loop.

After a failed batch call, an in-process or async reward is called again with each sample alone to
find the samples it fails on. With ``on_error: raise`` a failure is the :class:`RewardError` of
:meth:`ScoredReward.stop`.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import threading
from dataclasses import dataclass
from typing import Any

from lit_grpo.errors import ConfigError
from lit_grpo.scoring.event_loop import CallTimeout, await_call
from lit_grpo.scoring.failures import SampleFailure, indent, keep_training_hint, sample_lines
from lit_grpo.scoring.own_process import OwnProcesses
from lit_grpo.scoring.pool import PoolCancelled, PoolInitError, WorkerPool, pickle_reward
from lit_grpo.scoring.specs import RewardError, RewardSpec
from lit_grpo.scoring.values import reward_values

__all__ = ["Scored", "ScoredReward", "run_mode", "score_async", "score_in_pool", "score_in_process"]


@dataclass
class Scored:
    """What one reward gave for a batch: one float per sample (NaN for None) and its failures."""

    values: list[float]
    errors: list[SampleFailure]


@dataclass(frozen=True)
class ScoredReward:
    """One configured reward as the scorer runs it."""

    index: int  # k: its column of the [N, K] matrix, and the key of its worker processes
    spec: RewardSpec
    reward: Any  # the callable, YAML args bound (lit_grpo.scoring.arguments.build_reward)
    name: str  # in metrics: rewards/<name>/mean
    who: str  # in messages: Reward 'name' (package)
    where: str  # its config entry: model.rewards[k]

    @property
    def fill(self) -> float:
        """What a sample it fails on scores with ``on_error: none`` (NaN) or ``zero`` (0.0)."""
        return 0.0 if self.spec.on_error == "zero" else float("nan")

    def values(self, raw: Any, completions: list, sample: int | None = None) -> list[float]:
        return reward_values(self.who, raw, completions, sample)

    def stop(self, failure: SampleFailure | None, batch_failure: SampleFailure | None,
             kwargs: dict[str, Any]) -> RewardError:
        """The error that stops the run when this reward (``on_error: raise``) failed on the sample of
        ``failure``. ``batch_failure``: how a call with the whole batch failed, for a reward called
        with the batch; ``failure`` then comes from calling it again with each sample alone, and is
        None where it fails on none. The error's cause is the failing call's exception."""
        spec, n = self.spec, len(kwargs["completions"])
        if failure is None:
            lines = [batch_failure.headline(self.who, spec.timeout),
                     f"  while scoring {n} completions in one call; called again with each sample alone, "
                     "it failed on none"]
        else:
            how = ("(found by calling the reward again with each sample alone)" if batch_failure is not None
                   else f"in a worker process (num_workers={spec.num_workers})")
            lines = [failure.headline(self.who, spec.timeout), f"  while scoring sample {failure.index} of {n} {how}",
                     *sample_lines(failure.index, kwargs["prompts"], kwargs["completions"])]
        shown = failure or batch_failure
        if shown.traceback:
            lines.append(indent(shown.traceback, "  "))
        lines.append(keep_training_hint(self.where))
        error = RewardError("\n".join(lines))
        error.__cause__ = shown.exception
        return error


def run_mode(scored: ScoredReward) -> tuple[str, bytes | None]:
    """How the reward runs, ``pool`` (``num_workers > 0``), ``async`` (awaited) or ``local`` (called in
    the scorer's thread), and for ``pool`` the pickled reward its workers load; a ``ConfigError`` for
    a pool reward that cannot be pickled or a ``timeout`` on a local one."""
    spec, reward = scored.spec, scored.reward
    if spec.num_workers > 0:
        try:
            return "pool", pickle_reward(reward)
        except Exception as exc:
            raise ConfigError(
                f"{scored.where}.num_workers ({spec.name!r}): {scored.who} cannot run in worker "
                f"processes because it cannot be pickled ({type(exc).__name__}: {exc}). Functions and "
                "classes defined at the top level of an importable module pickle; lambdas, closures and "
                "functions defined inside other functions do not. Use num_workers: 0 for this reward."
            ) from exc
    if _is_async(reward):
        return "async", None
    if spec.timeout is not None:
        raise ConfigError(
            f"{scored.where}.timeout ({spec.name!r}): a timeout needs num_workers > 0 (or an async "
            "reward); a synchronous reward called in the training process cannot be interrupted. Set "
            "num_workers: 1 or more, or remove timeout."
        )
    return "local", None


def _is_async(reward: Any) -> bool:
    """An ``async def`` function (or partial of one), or an object whose ``__call__`` is ``async def``."""
    return inspect.iscoroutinefunction(reward) or inspect.iscoroutinefunction(getattr(type(reward), "__call__", None))


def _one(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """The keyword arguments of sample ``i`` alone: every list sliced to ``[i:i+1]``."""
    return {key: values[i : i + 1] for key, values in kwargs.items()}


def _failure(index: int | None, exc: BaseException) -> SampleFailure:
    return SampleFailure.from_exception(index, exc, timed_out=isinstance(exc, CallTimeout))


# -------------------------------------------------------------------------------------------------
# In-process rewards (num_workers: 0): called here in the main thread; off it, in a worker process
# of their own
# -------------------------------------------------------------------------------------------------


def score_in_process(scored: ScoredReward, kwargs: dict[str, Any], own_processes: OwnProcesses) -> Scored:
    """Call the reward with the whole batch; after a failed call, again with each sample alone to find
    the samples it fails on."""
    completions = kwargs["completions"]
    [(status, value)] = _call_in_process(scored, [kwargs], own_processes, batch=True)
    if status == "ok":
        return Scored(scored.values(value, completions), [])
    batch_failure = value
    samples = [_one(kwargs, i) for i in range(len(completions))]
    if scored.spec.on_error == "raise":
        results = _call_in_process(scored, samples, own_processes, stop_on_error=True)
        first = next((value for status, value in filter(None, results) if status == "error"), None)
        raise scored.stop(first, batch_failure, kwargs)
    values: list[float] = []
    errors: list[SampleFailure] = []
    for i, (status, value) in enumerate(_call_in_process(scored, samples, own_processes)):
        if status == "ok":
            values.extend(scored.values(value, completions[i : i + 1], sample=i))
        else:
            errors.append(value)
            values.append(scored.fill)
    return Scored(values, errors)


def _call_in_process(scored: ScoredReward, calls: list[dict[str, Any]], own_processes: OwnProcesses,
                     batch: bool = False, stop_on_error: bool = False) -> list[tuple[str, Any] | None]:
    """Call the reward once with each of ``calls`` (keyword arguments), here or, off the main thread,
    in its own worker process. One result per call: ``("ok", value)``, ``("error", SampleFailure)``
    (index: the call's position, or None for a ``batch`` call), or None where ``stop_on_error``
    stopped before it."""
    results = own_processes.run(scored.index, scored.reward, calls, scored.name, scored.who, batch, stop_on_error)
    if results is not None:
        return results
    results = [None] * len(calls)
    for i, one in enumerate(calls):
        try:
            results[i] = ("ok", scored.reward(**one))
        except Exception as exc:
            results[i] = ("error", _failure(None if batch else i, exc))
            if stop_on_error:
                break
    return results


# -------------------------------------------------------------------------------------------------
# Pool rewards (num_workers > 0): one sample per call, in worker processes
# -------------------------------------------------------------------------------------------------


def score_in_pool(scored: ScoredReward, kwargs: dict[str, Any], pool: WorkerPool, cancel: threading.Event) -> Scored:
    """Score each sample alone in ``pool``, the reward's worker processes, until ``cancel`` is set."""
    spec, completions = scored.spec, kwargs["completions"]
    tasks = []
    for i in range(len(completions)):
        try:
            tasks.append(pickle.dumps((i, _one(kwargs, i)), protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:
            raise RewardError(
                f"{scored.who} runs in worker processes (num_workers={spec.num_workers}), but the "
                f"arguments of sample {i} cannot be pickled ({type(exc).__name__}: {exc}); "
                "dataset columns must hold picklable values"
            ) from exc
    try:
        results = pool.run(tasks, timeout=spec.timeout, stop_on_error=spec.on_error == "raise", cancel=cancel)
    except PoolInitError as exc:
        raise RewardError(
            f"{scored.who} could not be loaded in a worker process (num_workers={spec.num_workers}): {exc}"
        ) from None
    except PoolCancelled:
        raise
    values: list[float] = []
    errors: list[SampleFailure] = []
    for i, result in enumerate(results):
        if result is None:  # not scored: the run stopped at the first failure (on_error: raise)
            values.append(float("nan"))
            continue
        status, payload = result
        if status == "ok":
            values.extend(scored.values(payload, completions[i : i + 1], sample=i))
        else:
            errors.append(SampleFailure(i, payload.kind, payload.type_name, payload.message, payload.traceback))
            values.append(scored.fill)
    if errors and spec.on_error == "raise":
        raise scored.stop(errors[0], None, kwargs)
    return Scored(values, errors)


# -------------------------------------------------------------------------------------------------
# Async rewards: awaited concurrently on the scorer's event loop
# -------------------------------------------------------------------------------------------------


async def score_async(scored: ScoredReward, kwargs: dict[str, Any]) -> Scored:
    """Await the reward with the whole batch, for at most its ``timeout``; after a failed call, once
    per sample, concurrently."""
    spec = scored.spec
    try:
        raw = await await_call(scored.reward, kwargs, spec.timeout)
    except Exception as exc:
        result = await _score_async_per_sample(scored, kwargs)
        if spec.on_error == "raise":
            first = result.errors[0] if result.errors else None
            raise scored.stop(first, _failure(None, exc), kwargs)
        return result
    return Scored(scored.values(raw, kwargs["completions"]), [])


async def _score_async_per_sample(scored: ScoredReward, kwargs: dict[str, Any]) -> Scored:
    """After a failed batch call: await the reward once per sample, concurrently."""

    async def one(i: int) -> tuple[Any, BaseException | None]:
        try:
            return await await_call(scored.reward, _one(kwargs, i), scored.spec.timeout), None
        except Exception as exc:
            return None, exc

    results = await asyncio.gather(*(one(i) for i in range(len(kwargs["completions"]))))
    values: list[float] = []
    errors: list[SampleFailure] = []
    for i, (raw, exc) in enumerate(results):
        if exc is not None:
            errors.append(_failure(i, exc))
            values.append(scored.fill)
        else:
            values.extend(scored.values(raw, kwargs["completions"][i : i + 1], sample=i))
    return Scored(values, errors)
