"""Scoring completions with the configured reward functions.

:class:`RewardScorer` turns the ``model.rewards`` list of the YAML config into one callable that
returns the ``[N, K]`` reward matrix (N completions, K rewards) the algorithm combines with
``weights``. Every reward is resolved by name through the plugin registry when the scorer is built,
so a misspelled reward fails before the model is loaded, not after the first generation.

Call convention (TRL-compatible, keyword arguments only)::

    reward(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

Return-value rules, checked for every call (a violation raises :class:`RewardError` naming the
reward):

* a ``list``, ``tuple``, 1-D ``torch.Tensor`` or 1-D ``numpy.ndarray`` with exactly one value per
  completion;
* each value is a real number (``int``, ``float``, numpy scalar, one-element tensor) or ``None``
  ("not applicable to this sample"; it becomes NaN in the matrix and is skipped by ``nansum``);
* ``bool`` values are accepted as 1.0 / 0.0 (handy for pass/fail checks);
* strings and other objects are errors, and so are NaN (return ``None`` instead) and ±inf.

Where a reward runs (``model.rewards[i]`` keys ``num_workers`` and ``timeout``)::

    rewards:
      - {name: exact_match}                                    # in-process, once per batch
      - {name: code_execution, num_workers: 4, timeout: 10, on_error: zero}

* ``num_workers: 0`` (default), synchronous reward: called once per batch in the training
  process. Right for fast pure functions: no pickling, no process hop. Called off the main thread
  (the asynchronous pipeline scores in a thread), in a worker process of its own instead, so that
  signal-based timeouts work as in the main thread (:mod:`lit_grpo.scoring.own_process`).
* ``num_workers: N > 0``: called once per *sample* (every argument a list of length 1) in a pool of
  N worker processes that the scorer owns and keeps between steps, so a slow CPU-bound reward uses
  N cores. The reward object must pickle (module-level functions and classes do, lambdas and
  closures do not); this is checked when the scorer is built. A worker loads a module it cannot
  import by name (a reward given as ``path/to/file.py:function``) from its file. Workers start with
  ``forkserver`` (``spawn`` where that is missing), never ``fork``, which is unsafe once torch runs
  threads.
* ``async def`` reward (a coroutine function, or an object with ``async def __call__``) and
  ``num_workers: 0``: awaited on an event loop the scorer keeps in a thread of its own (one loop
  for the scorer's life, so a client bound to a loop keeps working between steps). All async
  rewards of a batch are awaited concurrently.

Pool rewards, async rewards and in-process rewards of one batch all run at the same time.
``timeout`` (seconds, default none) bounds every call of a pool or async reward; a pool sample that
runs over has its worker process killed and replaced, so a hung sample cannot hang training. An
in-process call cannot be interrupted, so ``timeout`` on a synchronous ``num_workers: 0`` reward is
a configuration error.

``on_error`` (``raise`` | ``none`` | ``zero``) says what a reward that raises, times out, or whose
worker process dies does to the step:

* ``raise`` (default): :class:`RewardError` naming the reward and the sample it failed on (its
  index, prompt and completion), with the reward's own frames of the traceback and the ``on_error``
  setting that would keep training (:mod:`lit_grpo.scoring.failures`);
* ``none`` / ``zero``: only the failing samples score ``None`` (NaN) / ``0.0``. Failures are counted in
  :attr:`RewardScorer.last_error_counts`, which the module logs as ``rewards/<name>/errors``; the first
  failure of each error type is logged with its sample and traceback, then one line every
  :data:`~lit_grpo.scoring.failures.SUMMARY_EVERY` calls that failed (:class:`~lit_grpo.scoring.failures.FailureReports`).

Either way, after a failed batch call an in-process or async reward is called again one sample at a
time to find the samples it fails on.

Return values that break the rules above are a :class:`RewardError` whatever ``on_error`` says:
they are bugs in the reward, which would misbehave the same way on every batch, not failures of
one sample, and turning them into ``None`` or ``0.0`` would hide a broken reward behind a constant
score. A reward that cannot score a sample returns ``None`` for it.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import logging
import math
import numbers
import pickle
import threading
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lit_grpo import plugins
from lit_grpo.errors import ConfigError
from lit_grpo.scoring.arguments import build_reward, check_accepts, check_columns
from lit_grpo.scoring.event_loop import CallTimeout, EventLoopThread, await_call
from lit_grpo.scoring.failures import FailureReports, SampleFailure, indent, keep_training_hint, preview, sample_lines
from lit_grpo.scoring.own_process import OwnProcesses
from lit_grpo.scoring.pool import PoolCancelled, PoolInitError, WorkerPool, pickle_reward
from lit_grpo.scoring.specs import RewardError, RewardSpec, as_spec, check_spec, expand_reward_groups, metric_names

try:  # numpy comes with torch in practice, but the scorer does not require it
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

__all__ = ["RewardScorer", "check_data_columns"]

logger = logging.getLogger(__name__)


def _is_async(reward: Any) -> bool:
    """An ``async def`` function (or partial of one), or an object whose ``__call__`` is ``async def``."""
    return inspect.iscoroutinefunction(reward) or inspect.iscoroutinefunction(getattr(type(reward), "__call__", None))


def _one(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """The keyword arguments of sample ``i`` alone: every list sliced to ``[i:i+1]``."""
    return {key: values[i : i + 1] for key, values in kwargs.items()}


@dataclass
class _Scored:
    """What one reward gave for a batch: one float per sample (NaN for None) and its failures."""

    values: list[float]
    errors: list[SampleFailure]


def _failure(index: int | None, exc: BaseException) -> SampleFailure:
    return SampleFailure.from_exception(index, exc, timed_out=isinstance(exc, CallTimeout))


class _Job(threading.Thread):
    """Runs ``fn(*args)`` in a thread, keeping its result or exception."""

    def __init__(self, name: str, fn: Any, *args: Any):
        super().__init__(name=name, daemon=True)
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001  (re-raised by the scorer's thread)
            self.error = exc


_LIVE_SCORERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all_scorers() -> None:
    for scorer in list(_LIVE_SCORERS):
        try:
            scorer.close()
        except Exception:  # noqa: BLE001
            pass


class RewardScorer:
    """Scores completions with a fixed list of rewards.

    ``scorer(prompts, completions, completion_ids, columns)`` returns a float32 tensor
    ``[N, K]``: column k holds reward ``names[k]``, NaN where that reward returned ``None`` (or
    failed on the sample with ``on_error: none``). ``weights`` (``[K]``) holds the configured
    weights; combining is the caller's business. After each call, ``last_error_counts`` maps every
    reward name to the number of samples it failed on in that call.

    A scorer with ``num_workers > 0`` rewards owns worker processes, and one with async rewards an
    event-loop thread; both start on first use and stop with :meth:`close` (also called when the
    scorer is garbage-collected and at interpreter exit). Pickling or deep-copying a scorer leaves
    them behind: the copy starts its own. ``run_settings`` (e.g. ``{"max_completion_len": 256}``) fill
    parameters of those names that a reward's ``args`` leave out. ``key`` is the config key of
    ``specs``, which messages name (``model.rewards`` or ``model.eval_rewards``).

    ``names`` are the rewards' names in metrics and logs (:func:`~lit_grpo.scoring.specs.metric_names`:
    a function's name, a plugin's registered name); messages name a reward as configured.
    """

    def __init__(self, specs: Sequence[RewardSpec | Mapping[str, Any]], run_settings: Mapping[str, Any] | None = None,
                 key: str = "model.rewards"):
        self._pools: dict[int, WorkerPool] = {}
        self._loop: EventLoopThread | None = None
        self._own_processes = OwnProcesses()  # in-process rewards called off the main thread
        self.key = key
        specs = [as_spec(spec, f"{key}[{i}]") for i, spec in enumerate(specs or [])]
        if not specs:
            raise ConfigError(
                f"{key} is empty: configure at least one reward, e.g. "
                "`rewards: [{name: char_fraction, args: {chars: 'a'}}]`; "
                "run `lit-grpo rewards` to list the installed ones"
            )
        first_index: dict[str, int] = {}
        for i, spec in enumerate(specs):
            if not isinstance(spec.name, str) or not spec.name:
                raise ConfigError(f"{key}[{i}].name must be a non-empty string, got {spec.name!r}")
            if spec.name in first_index:
                raise ConfigError(
                    f"reward {spec.name!r} is configured twice in {key} (entries "
                    f"{first_index[spec.name]} and {i}); each reward may appear once, since its "
                    "name keys its metrics (rewards/<name>/mean)"
                )
            first_index[spec.name] = i
            if isinstance(spec.weight, bool) or not isinstance(spec.weight, numbers.Real) or not math.isfinite(spec.weight):
                raise ConfigError(
                    f"{key}[{i}] ({spec.name!r}): weight must be a finite number, got {spec.weight!r}"
                )
            check_spec(f"{key}[{i}]", spec)
        specs = expand_reward_groups(specs, key)
        duplicated = [name for name, count in Counter(spec.name for spec in specs).items() if count > 1]
        if duplicated:
            raise ConfigError(f"reward {duplicated[0]!r} is configured twice in {key} (once through a reward group); "
                              "each reward may appear once, since its name keys its metrics")
        self.specs: list[RewardSpec] = specs
        self.names: list[str] = metric_names([spec.name for spec in specs])
        self.infos: list[plugins.RegistryEntry] = [plugins.get_reward(spec.name) for spec in specs]
        self.rewards: list[Any] = []
        for i, spec in enumerate(specs):
            try:
                self.rewards.append(build_reward(spec.name, spec.args, run_settings))
            except plugins.RewardArgumentError as error:
                raise plugins.RewardArgumentError(f"{error} ({key}[{i}].args)") from None
        self.weights: torch.Tensor = torch.tensor([float(spec.weight) for spec in specs], dtype=torch.float32)  # [K]
        # How each reward runs: "pool" (num_workers > 0), "async" (awaited) or "local" (called here).
        self.modes: list[str] = []
        self._payloads: dict[int, bytes] = {}
        for k, (spec, reward) in enumerate(zip(specs, self.rewards)):
            if spec.num_workers > 0:
                self.modes.append("pool")
                try:
                    self._payloads[k] = pickle_reward(reward)
                except Exception as exc:
                    raise ConfigError(
                        f"{key}[{k}].num_workers ({spec.name!r}): {self._who(k)} cannot run in worker "
                        f"processes because it cannot be pickled ({type(exc).__name__}: {exc}). Functions and "
                        "classes defined at the top level of an importable module pickle; lambdas, closures and "
                        "functions defined inside other functions do not. Use num_workers: 0 for this reward."
                    ) from exc
            elif _is_async(reward):
                self.modes.append("async")
            else:
                self.modes.append("local")
                if spec.timeout is not None:
                    raise ConfigError(
                        f"{key}[{k}].timeout ({spec.name!r}): a timeout needs num_workers > 0 (or an async "
                        "reward); a synchronous reward called in the training process cannot be interrupted. Set "
                        "num_workers: 1 or more, or remove timeout."
                    )
        self.last_error_counts: dict[str, int] = {name: 0 for name in self.names}
        self._failure_reports = [FailureReports() for _ in self.specs]
        _LIVE_SCORERS.add(self)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}*{w:g}" for n, w in zip(self.names, self.weights.tolist()))
        return f"RewardScorer({parts})"

    def check_columns(self, columns: Sequence[str], source: str) -> None:
        """Before the run: every parameter that only a dataset column can fill names one of
        ``columns`` (those the ``source`` dataset passes to rewards), else a ``DataError`` naming both; and
        every reward takes the keyword arguments a call passes it (``check_accepts``)."""
        for k, reward in enumerate(self.rewards):
            check_columns(self._who(k), reward, columns, source, f"{self.key}[{k}]")
            check_accepts(self._who(k), reward, columns, f"{self.key}[{k}]")

    # ---------------------------------------------------------------------------------------------
    # Lifecycle: worker pools and the event-loop thread
    # ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes and the event-loop thread. The scorer stays usable: they
        start again on the next call that needs them."""
        pools, self._pools = getattr(self, "_pools", {}), {}
        for pool in pools.values():
            pool.close()
        if hasattr(self, "_own_processes"):
            self._own_processes.close()
        loop, self._loop = getattr(self, "_loop", None), None
        if loop is not None:
            loop.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pools"] = {}
        state["_own_processes"] = OwnProcesses()
        state["_loop"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _LIVE_SCORERS.add(self)

    def _pool(self, k: int) -> WorkerPool:
        pool = self._pools.get(k)
        if pool is None:
            pool = self._pools[k] = WorkerPool(self._payloads[k], self.specs[k].num_workers, name=self.names[k])
        return pool

    def _event_loop(self) -> EventLoopThread:
        if self._loop is None:
            self._loop = EventLoopThread()
        return self._loop

    # ---------------------------------------------------------------------------------------------

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: Mapping[str, list] | None = None,
    ) -> torch.Tensor:
        columns = dict(columns or {})
        n = len(completions)
        self._check_inputs(prompts, completions, completion_ids, columns)
        self.last_error_counts = {name: 0 for name in self.names}
        scores = torch.full((n, len(self.rewards)), float("nan"), dtype=torch.float32)  # [N, K]
        if n == 0:
            return scores
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

        # Start pool rewards (one thread each, waiting on its workers) and async rewards (on the
        # event loop), then score in-process rewards here while they run.
        cancel = threading.Event()
        jobs = [
            _Job(f"lit-grpo-reward-{self.names[k]}", self._score_pool, k, kwargs, cancel)
            for k, mode in enumerate(self.modes)
            if mode == "pool"
        ]
        async_ks = [k for k, mode in enumerate(self.modes) if mode == "async"]
        outcomes: dict[int, _Scored] = {}
        errors: dict[int, BaseException] = {}
        async_future = None
        try:
            for job in jobs:
                job.start()
            if async_ks:
                async_future = self._event_loop().submit(self._score_async_all(async_ks, kwargs))
            for k, mode in enumerate(self.modes):
                if mode == "local":
                    outcomes[k] = self._score_local(k, kwargs)
            for job in jobs:
                job.join()
            if async_future is not None:
                for k, result in async_future.result().items():
                    (errors if isinstance(result, BaseException) else outcomes)[k] = result
        except BaseException:
            cancel.set()
            if async_future is not None:
                async_future.cancel()
            for job in jobs:
                if job.is_alive():
                    job.join()
            raise
        for job in jobs:
            k = job.args[0]
            if job.error is not None:
                errors[k] = job.error
            else:
                outcomes[k] = job.result
        if errors:
            raise errors[min(errors)]

        for k in range(len(self.rewards)):
            outcome = outcomes[k]
            scores[:, k] = torch.tensor(outcome.values, dtype=torch.float32)
            self.last_error_counts[self.names[k]] = len(outcome.errors)
            if outcome.errors:
                self._warn(k, outcome.errors, kwargs)
        return scores

    def _check_inputs(self, prompts: list, completions: list, completion_ids: list, columns: dict) -> None:
        n = len(completions)
        if len(prompts) != n or len(completion_ids) != n:
            raise ValueError(
                f"RewardScorer needs one prompt and one completion_ids entry per completion: got "
                f"{len(prompts)} prompts, {n} completions, {len(completion_ids)} completion_ids"
            )
        for key, values in columns.items():
            if key in plugins.RESERVED_ARGS:
                raise ConfigError(
                    f"dataset column {key!r} clashes with the reward argument of the same name; rename the column"
                )
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")

    def _fill(self, k: int) -> float:
        return 0.0 if self.specs[k].on_error == "zero" else float("nan")

    # ---------------------------------------------------------------------------------------------
    # In-process rewards (num_workers: 0): called here in the main thread; off it, in a worker
    # process of their own
    # ---------------------------------------------------------------------------------------------

    def _score_local(self, k: int, kwargs: dict[str, Any]) -> _Scored:
        """Call reward ``k`` with the whole batch; after a failed call, again with each sample alone
        to find the samples it fails on."""
        prompts, completions = kwargs["prompts"], kwargs["completions"]
        [(status, value)] = self._call_local(k, [kwargs], batch=True)
        if status == "ok":
            return _Scored(self.validate(k, value, prompts, completions), [])
        batch_failure = value
        samples = [_one(kwargs, i) for i in range(len(completions))]
        if self.specs[k].on_error == "raise":
            results = self._call_local(k, samples, stop_on_error=True)
            first = next((value for status, value in filter(None, results) if status == "error"), None)
            raise self._stop(k, first, batch_failure, kwargs)
        values: list[float] = []
        errors: list[SampleFailure] = []
        for i, (status, value) in enumerate(self._call_local(k, samples)):
            if status == "ok":
                values.extend(self.validate(k, value, prompts[i : i + 1], completions[i : i + 1], sample=i))
            else:
                errors.append(value)
                values.append(self._fill(k))
        return _Scored(values, errors)

    def _call_local(self, k: int, calls: list[dict[str, Any]], batch: bool = False,
                    stop_on_error: bool = False) -> list[tuple[str, Any] | None]:
        """Call reward ``k`` once with each of ``calls`` (keyword arguments), here or, off the main
        thread, in its own worker process (:class:`~lit_grpo.scoring.own_process.OwnProcesses`). One
        result per call: ``("ok", value)``, ``("error", SampleFailure)`` (index: the call's position,
        or None for a ``batch`` call), or None where ``stop_on_error`` stopped before it."""
        results = self._own_processes.run(k, self.rewards[k], calls, self.names[k], self._who(k), batch, stop_on_error)
        if results is not None:
            return results
        results = [None] * len(calls)
        for i, one in enumerate(calls):
            try:
                results[i] = ("ok", self.rewards[k](**one))
            except Exception as exc:
                results[i] = ("error", _failure(None if batch else i, exc))
                if stop_on_error:
                    break
        return results

    # ---------------------------------------------------------------------------------------------
    # Pool rewards (num_workers > 0): one sample per call, in worker processes
    # ---------------------------------------------------------------------------------------------

    def _score_pool(self, k: int, kwargs: dict[str, Any], cancel: threading.Event) -> _Scored:
        spec = self.specs[k]
        prompts, completions = kwargs["prompts"], kwargs["completions"]
        tasks = []
        for i in range(len(completions)):
            try:
                tasks.append(pickle.dumps((i, _one(kwargs, i)), protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as exc:
                raise RewardError(
                    f"{self._who(k)} runs in worker processes (num_workers={spec.num_workers}), but the "
                    f"arguments of sample {i} cannot be pickled ({type(exc).__name__}: {exc}); "
                    "dataset columns must hold picklable values"
                ) from exc
        try:
            results = self._pool(k).run(
                tasks, timeout=spec.timeout, stop_on_error=spec.on_error == "raise", cancel=cancel
            )
        except PoolInitError as exc:
            raise RewardError(
                f"{self._who(k)} could not be loaded in a worker process (num_workers={spec.num_workers}): {exc}"
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
                values.extend(self.validate(k, payload, prompts[i : i + 1], completions[i : i + 1], sample=i))
            else:
                errors.append(SampleFailure(i, payload.kind, payload.type_name, payload.message, payload.traceback))
                values.append(self._fill(k))
        if errors and spec.on_error == "raise":
            raise self._stop(k, errors[0], None, kwargs)
        return _Scored(values, errors)

    # ---------------------------------------------------------------------------------------------
    # Async rewards: awaited concurrently on the scorer's event loop
    # ---------------------------------------------------------------------------------------------

    async def _score_async_all(self, ks: list[int], kwargs: dict[str, Any]) -> dict[int, _Scored | BaseException]:
        results = await asyncio.gather(*(self._score_async(k, kwargs) for k in ks), return_exceptions=True)
        return dict(zip(ks, results))

    async def _score_async(self, k: int, kwargs: dict[str, Any]) -> _Scored:
        spec = self.specs[k]
        prompts, completions = kwargs["prompts"], kwargs["completions"]
        try:
            raw = await await_call(self.rewards[k], kwargs, spec.timeout)
        except Exception as exc:
            scored = await self._score_async_per_sample(k, kwargs)
            if spec.on_error == "raise":
                first = scored.errors[0] if scored.errors else None
                raise self._stop(k, first, _failure(None, exc), kwargs)
            return scored
        return _Scored(self.validate(k, raw, prompts, completions), [])

    async def _score_async_per_sample(self, k: int, kwargs: dict[str, Any]) -> _Scored:
        """After a failed batch call: await reward ``k`` once per sample, concurrently."""
        timeout = self.specs[k].timeout

        async def one(i: int) -> tuple[Any, BaseException | None]:
            try:
                return await await_call(self.rewards[k], _one(kwargs, i), timeout), None
            except Exception as exc:
                return None, exc

        results = await asyncio.gather(*(one(i) for i in range(len(kwargs["completions"]))))
        values: list[float] = []
        errors: list[SampleFailure] = []
        for i, (raw, exc) in enumerate(results):
            if exc is not None:
                errors.append(_failure(i, exc))
                values.append(self._fill(k))
            else:
                values.extend(self.validate(k, raw, kwargs["prompts"][i : i + 1], kwargs["completions"][i : i + 1], sample=i))
        return _Scored(values, errors)

    # ---------------------------------------------------------------------------------------------
    # Errors and warnings
    # ---------------------------------------------------------------------------------------------

    def _stop(self, k: int, failure: SampleFailure | None, batch_failure: SampleFailure | None,
              kwargs: dict[str, Any]) -> RewardError:
        """The error that stops the run when reward ``k`` (``on_error: raise``) failed on the sample of
        ``failure``. ``batch_failure``: how a call with the whole batch failed, for a reward called
        with the batch; ``failure`` then comes from calling it again with each sample alone, and is
        None where it fails on none. The error's cause is the failing call's exception."""
        spec, n = self.specs[k], len(kwargs["completions"])
        who = self._who(k)
        if failure is None:
            lines = [batch_failure.headline(who, spec.timeout),
                     f"  while scoring {n} completions in one call; called again with each sample alone, "
                     "it failed on none"]
        else:
            how = ("(found by calling the reward again with each sample alone)" if batch_failure is not None
                   else f"in a worker process (num_workers={spec.num_workers})")
            lines = [failure.headline(who, spec.timeout), f"  while scoring sample {failure.index} of {n} {how}",
                     *sample_lines(failure.index, kwargs["prompts"], kwargs["completions"])]
        shown = failure or batch_failure
        if shown.traceback:
            lines.append(indent(shown.traceback, "  "))
        lines.append(keep_training_hint(f"{self.key}[{k}]"))
        error = RewardError("\n".join(lines))
        error.__cause__ = shown.exception
        return error

    def _warn(self, k: int, errors: list[SampleFailure], kwargs: dict[str, Any]) -> None:
        """The first failure of each error type in full (its sample, the reward's own frames); after that a
        line every :data:`~lit_grpo.scoring.failures.SUMMARY_EVERY` calls that failed (:class:`FailureReports`)."""
        spec, reports, n = self.specs[k], self._failure_reports[k], len(kwargs["completions"])
        fill = "None (NaN)" if spec.on_error == "none" else "0.0"
        first = reports.first_of_its_kind(errors)
        if first is None:
            reports.count(errors, n)
            summary = reports.summary_due()
            if summary is not None:
                logger.warning(f"{self._who(k)} {summary}; they score {fill} (on_error: {spec.on_error}), counted in "
                               f"rewards/{self.names[k]}/errors")
            return
        kinds = Counter(error.type_name for error in errors)
        text = (
            f"{self._who(k)} failed on {len(errors)} of {n} samples "
            f"({', '.join(f'{count} {name}' for name, count in kinds.most_common())}); they score {fill} "
            f"(on_error: {spec.on_error}). First, sample {first.index}: {first.summary}\n"
        )
        text += "\n".join(sample_lines(first.index, kwargs["prompts"], kwargs["completions"]))
        if first.traceback:
            text += "\n" + indent(first.traceback)
        text += (f"\nFurther failures of this reward are counted in rewards/{self.names[k]}/errors, and summed up "
                 f"here every {reports.every} steps that fail")
        logger.warning(text)

    # ---------------------------------------------------------------------------------------------
    # Validation of returned values
    # ---------------------------------------------------------------------------------------------

    def validate(self, k: int, raw: Any, prompts: list, completions: list, sample: int | None = None) -> list[float]:
        """Check reward ``k``'s return value; one float per completion, NaN for ``None``.

        ``sample`` is set when the reward was called with that one sample alone (``num_workers > 0``,
        or the per-sample retry after a failed batch call); messages then name it.
        """
        n = len(completions)
        who = self._who(k)
        alone = f" when called with sample {sample} alone" if sample is not None else ""
        if isinstance(raw, torch.Tensor) or (np is not None and isinstance(raw, np.ndarray)):
            if raw.ndim != 1:
                raise RewardError(
                    f"{who} returned a {type(raw).__name__} of shape {tuple(raw.shape)}{alone}; "
                    f"expected a 1-D sequence of {n} values (one per completion)"
                )
            if isinstance(raw, torch.Tensor):
                raw = raw.detach().cpu()
            values = raw.tolist()
        elif isinstance(raw, (list, tuple)):
            values = raw
        else:
            raise RewardError(
                f"{who} returned {type(raw).__name__} ({preview(raw)}){alone}; expected a list of {n} "
                "floats or None, one per completion"
            )
        if len(values) != n:
            raise RewardError(f"{who} returned {len(values)} values{alone}; expected {n} (one per completion)")
        first = 0 if sample is None else sample
        return [self._to_float(who, first + i, value, completions[i]) for i, value in enumerate(values)]

    @staticmethod
    def _to_float(who: str, i: int, value: Any, completion: Any) -> float:
        if value is None:
            return float("nan")
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            value = value.item()
        elif np is not None and isinstance(value, np.generic) and not isinstance(value, np.complexfloating):
            value = value.item()
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"{who} returned {type(value).__name__} {preview(value)} for sample {i} "
                f"(completion {preview(completion)}); rewards must be numbers (float, int, bool) "
                "or None"
            )
        number = float(value)
        if math.isnan(number):
            raise RewardError(
                f"{who} returned NaN for sample {i}; return None to mark a sample as not applicable"
            )
        if math.isinf(number):
            raise RewardError(
                f"{who} returned {number} for sample {i} (completion {preview(completion)}); "
                "rewards must be finite"
            )
        return number

    def _who(self, k: int) -> str:
        """``Reward 'name' (package)``, the reward named as configured."""
        return f"Reward '{self.specs[k].name}' ({self.infos[k].label})"


def check_data_columns(datamodule: Any, scorer: RewardScorer, eval_scorer: RewardScorer, environments: Any) -> None:
    """Before the run: each parameter that only a dataset column can fill, of the rewards (``eval_scorer``'s
    for the validation split) and of the environments (``lit_grpo.rollout.tools.environments.Environments``), names a
    column of each split the data module has loaded (its ``passed_columns``), else a ``DataError`` naming both."""
    if not hasattr(datamodule, "passed_columns"):
        return
    for split, split_scorer in (("train", scorer), ("val", eval_scorer)):
        passed = datamodule.passed_columns(split)  # None: a split this run does not load
        if passed is None:
            continue
        source, columns = passed
        split_scorer.check_columns(columns, source)
        for spec in getattr(environments, "specs", []):
            environment = environments.get_environment(spec.name)
            check_columns(f"environment {spec.name!r}", environment, columns, source, "model.environment", spec.args)
