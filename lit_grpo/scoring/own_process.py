"""In-process rewards called off the main thread, in a worker process of their own (used by
:mod:`lit_grpo.scoring.scorer`).

A reward with ``num_workers: 0`` is called once per batch in the training process. The
asynchronous pipeline (``model.max_staleness > 0``) scores in a thread, where signal-based timeouts
do not work: Math-Verify's ``parse`` and ``verify`` with their default timeouts raise there
("doesn't support threaded environment"), and lit-grpo's math rewards run without their
``timeout_seconds`` (a pathological answer would block the pipeline). So off the main thread each
such reward runs in a worker process of its own (:class:`~lit_grpo.scoring.pool.WorkerPool` of one,
started on first use and kept), still once per batch, where it behaves as in the main thread.

The cost: the batch's arguments and the rewards' values are pickled across (measured: 2 ms on top
of 11 ms for ``numeric_accuracy`` on 128 GSM8K completions, 2 busy cores); the first start of a
worker process starts multiprocessing's fork server once per trainer process (seconds: it imports
the trainer's main module); and state the reward keeps lives in that process. A reward that
declares itself thread-safe (``thread_safe = True`` on the function or class: lit-grpo-rewards'
that use no signals, and ``reward_model``, whose model stays on the trainer's GPU) stays in the
thread; so does one that holds torch tensors or modules (a reward model on a GPU: a process of its
own would copy it), one that cannot be pickled (a lambda, a closure), whose batch cannot be pickled,
or that a worker cannot load, with a warning (once) saying why.
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
from typing import Any

from lit_grpo.scoring.failures import SampleFailure
from lit_grpo.scoring.pool import HoldsTorchState, PoolInitError, WorkerPool, pickle_reward

__all__ = ["OwnProcesses"]

logger = logging.getLogger("lit_grpo.scoring.scorer")  # the scorer's: its warnings are the scorer's


class OwnProcesses:
    """The worker processes of a scorer's in-process rewards, by reward index ``k``, and the rewards
    that stay in the calling thread (see the module doc)."""

    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}
        self.in_thread: dict[int, str | None] = {}  # k -> why (None: the reward says it is thread-safe)

    def run(self, k: int, reward: Any, calls: list[dict[str, Any]], name: str, who: str, batch: bool = False,
            stop_on_error: bool = False) -> list[tuple[str, Any] | None] | None:
        """Reward ``k``'s result for each of ``calls`` (keyword arguments) from its own process:
        ``("ok", value)``, ``("error", SampleFailure)`` (index: the call's position, or None for a
        ``batch`` call), or None where ``stop_on_error`` stopped before it. None instead of the list
        when the calls are to be made in the calling thread (the main thread, or a reward that stays)."""
        pool = self._pool(k, reward, name, who)
        if pool is None:
            return None
        try:
            tasks = [pickle.dumps((i, one), protocol=pickle.HIGHEST_PROTOCOL) for i, one in enumerate(calls)]
        except Exception as exc:  # noqa: BLE001  (whatever pickling raises)
            self._keep_in_thread(k, who, f"the arguments of its batch cannot be pickled ({type(exc).__name__}: {exc})")
            return None
        try:
            results = pool.run(tasks, stop_on_error=stop_on_error)
        except PoolInitError as exc:
            self._keep_in_thread(k, who, f"a worker process cannot load it ({exc})")
            return None
        return [
            ("error", SampleFailure(None if batch else i, result[1].kind, result[1].type_name, result[1].message,
                                    result[1].traceback))
            if result is not None and result[0] == "error" else result
            for i, result in enumerate(results)
        ]

    def _pool(self, k: int, reward: Any, name: str, who: str) -> WorkerPool | None:
        """Reward ``k``'s process, started on first use off the main thread; None in the main thread
        and for a reward that stays in the calling thread."""
        if threading.current_thread() is threading.main_thread() or k in self.in_thread:
            return None
        pool = self.pools.get(k)
        if pool is not None:
            return pool
        if getattr(reward.func if isinstance(reward, functools.partial) else reward, "thread_safe", False) is True:
            self.in_thread[k] = None
            return None
        try:
            payload = pickle_reward(reward, torch_state=False)
        except HoldsTorchState as exc:
            self._keep_in_thread(k, who, str(exc))
            return None
        except Exception as exc:  # noqa: BLE001  (whatever pickling raises)
            self._keep_in_thread(k, who, f"it cannot be pickled ({type(exc).__name__}: {exc})")
            return None
        pool = self.pools[k] = WorkerPool(payload, 1, name=name)
        return pool

    def _keep_in_thread(self, k: int, who: str, reason: str) -> None:
        """From now on, reward ``k`` is scored in the calling thread (its process, if any, stops); say why."""
        self.in_thread[k] = reason
        pool = self.pools.pop(k, None)
        if pool is not None:
            pool.close()
        logger.warning(
            f"{who} runs in the scoring thread of the asynchronous pipeline (model.max_staleness > 0), "
            f"not in a worker process of its own as other in-process rewards do there, because {reason}. In a "
            "thread, signal-based timeouts do not work: Math-Verify's parse and verify with their default "
            "timeouts raise there, and lit-grpo's math rewards run without their timeout_seconds. Define the "
            "reward at the top level of an importable module (or a file named as path/to/file.py:function) to "
            "score it as in the main thread."
        )

    def close(self) -> None:
        """Stop the processes; they start again on the next call off the main thread that needs them."""
        pools, self.pools = self.pools, {}
        for pool in pools.values():
            pool.close()
