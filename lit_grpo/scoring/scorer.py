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

import atexit
import logging
import threading
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from lit_grpo import plugins
from lit_grpo.errors import ConfigError
from lit_grpo.scoring.arguments import build_reward, check_accepts, check_columns
from lit_grpo.scoring.event_loop import EventLoopThread
from lit_grpo.scoring.failures import FailureReports, SampleFailure, indent, sample_lines
from lit_grpo.scoring.own_process import OwnProcesses
from lit_grpo.scoring.pool import WorkerPool
from lit_grpo.scoring.runners import Scored, ScoredReward, run_mode, score_async, score_in_pool, score_in_process
from lit_grpo.scoring.specs import RewardSpec, checked_specs, metric_names

__all__ = ["RewardScorer", "check_data_columns"]

logger = logging.getLogger(__name__)


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
        specs = checked_specs(specs, key)
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
        self.scored: list[ScoredReward] = [
            ScoredReward(k, spec, reward, name, f"Reward '{spec.name}' ({info.label})", f"{key}[{k}]")
            for k, (spec, reward, name, info) in enumerate(zip(specs, self.rewards, self.names, self.infos))
        ]
        # How each reward runs: "pool" (num_workers > 0), "async" (awaited) or "local" (called here);
        # a pool reward's workers load its pickled payload.
        self.modes: list[str] = []
        self._payloads: dict[int, bytes] = {}
        for k, scored in enumerate(self.scored):
            mode, payload = run_mode(scored)
            self.modes.append(mode)
            if payload is not None:
                self._payloads[k] = payload
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
            check_columns(self.scored[k].who, reward, columns, source, f"{self.key}[{k}]")
            check_accepts(self.scored[k].who, reward, columns, f"{self.key}[{k}]")

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
        outcomes = self._score_all(kwargs)
        for k, outcome in enumerate(outcomes):
            scores[:, k] = torch.tensor(outcome.values, dtype=torch.float32)
            self.last_error_counts[self.names[k]] = len(outcome.errors)
            if outcome.errors:
                self._warn(k, outcome.errors, kwargs)
        return scores

    def _score_all(self, kwargs: dict[str, Any]) -> list[Scored]:
        """Every reward's outcome, in the order of :attr:`names`. Pool rewards start first (a thread
        each, waiting on its workers), then async rewards (on the event loop); in-process rewards are
        called in this thread meanwhile (a reward may work only in the main thread: signal-based
        timeouts). The first error, by reward order, is raised once every reward has stopped."""
        cancel = threading.Event()  # set: the pools stop scoring (an in-process reward raised)
        pool_rewards = [scored for scored in self.scored if self.modes[scored.index] == "pool"]
        outcomes: dict[int, Scored] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(pool_rewards)), thread_name_prefix="lit-grpo-reward") as threads:
            futures: dict[int, Future] = {
                scored.index: threads.submit(score_in_pool, scored, kwargs, self._pool(scored.index), cancel)
                for scored in pool_rewards
            }
            futures.update({scored.index: self._event_loop().submit(score_async(scored, kwargs))
                            for scored in self.scored if self.modes[scored.index] == "async"})
            try:
                for scored in self.scored:
                    if self.modes[scored.index] == "local":
                        outcomes[scored.index] = score_in_process(scored, kwargs, self._own_processes)
                wait(futures.values())
            except BaseException:
                cancel.set()
                for future in futures.values():
                    future.cancel()  # an async reward's task; a pool's thread stops on cancel
                raise  # leaving the executor waits for the pools' threads
        errors = {k: future.exception() for k, future in futures.items() if future.exception() is not None}
        if errors:
            raise errors[min(errors)]
        outcomes.update({k: future.result() for k, future in futures.items()})
        return [outcomes[k] for k in range(len(self.scored))]

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
                logger.warning(f"{self.scored[k].who} {summary}; they score {fill} (on_error: {spec.on_error}), counted in "
                               f"rewards/{self.names[k]}/errors")
            return
        kinds = Counter(error.type_name for error in errors)
        text = (
            f"{self.scored[k].who} failed on {len(errors)} of {n} samples "
            f"({', '.join(f'{count} {name}' for name, count in kinds.most_common())}); they score {fill} "
            f"(on_error: {spec.on_error}). First, sample {first.index}: {first.summary}\n"
        )
        text += "\n".join(sample_lines(first.index, kwargs["prompts"], kwargs["completions"]))
        if first.traceback:
            text += "\n" + indent(first.traceback)
        text += (f"\nFurther failures of this reward are counted in rewards/{self.names[k]}/errors, and summed up "
                 f"here every {reports.every} steps that fail")
        logger.warning(text)


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
