"""Worker processes for rewards configured with ``num_workers > 0``, and for in-process rewards
scored off the main thread (a process of one each; used by :mod:`lit_grpo.scoring`).

Standard-library only on purpose (and :mod:`lit_grpo.scoring.failures`, which is too; the package's
``__init__`` imports the rest on first use): a worker process imports this module, and a pool worker
should start in milliseconds, not re-import torch.

Why not ``concurrent.futures.ProcessPoolExecutor`` or ``multiprocessing.Pool``? Neither can stop one
running task: a sample that hangs would hold its worker forever, and a worker that dies takes every
pending future down with it (``BrokenProcessPool``) or leaves its task unanswered (``Pool``). Here
each worker runs one task at a time over its own pipe, so the pool always knows which sample a
worker is busy with: a sample that runs past its deadline gets its worker killed and replaced, a
worker that dies is charged to the sample it was scoring, and every other sample is unaffected.

Protocol (every message is a ``pickle`` of a tuple, sent with ``send_bytes``)::

    worker -> pool   ("ready", None)                       reward unpickled, waiting for work
                     ("init_error", traceback_text)        the reward could not be unpickled
                     ("ok", task_id, value)                the reward returned ``value``
                     ("error", task_id, (type, message, traceback_text))   the reward's frames only
    pool -> worker   (task_id, kwargs)                     call ``reward(**kwargs)``
                     None                                  exit
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from collections import deque
from dataclasses import dataclass
from typing import Any

from lit_grpo.scoring.failures import reward_traceback

# How long a new worker may take to import the reward's module before the pool gives up on it.
STARTUP_TIMEOUT = 300.0
# How often a waiting pool checks whether the scorer asked it to stop.
_POLL = 0.1


def default_start_method() -> str:
    """``forkserver`` where available (cheap starts, and safe once torch has started threads), else ``spawn``.

    Never ``fork``: forking a process that runs torch's (or CUDA's) threads can deadlock the child.
    """
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


@dataclass
class Failure:
    """Why one task produced no value. ``kind`` is ``exception``, ``timeout`` or ``crash``."""

    kind: str
    type_name: str
    message: str
    traceback: str = ""


class PoolInitError(RuntimeError):
    """A worker could not load the reward (unpickling it failed, or the worker died while starting)."""


class PoolCancelled(RuntimeError):
    """The caller asked the pool to stop before every task finished."""


# --------------------------------------------------------------------------------------------------
# The reward, as a worker receives it
# --------------------------------------------------------------------------------------------------


class _RecordingPickler(pickle.Pickler):
    """A pickler that notes the source file of the module of every function and class it pickles
    by reference (``modules``: module name -> file)."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: dict[str, str] = {}
        self.torch_state = False  # whether it pickled a torch object (a tensor, a module's parameter)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)):
            name = getattr(obj, "__module__", None)
            path = getattr(sys.modules.get(name or ""), "__file__", None)
            if name and name != "__main__" and path:  # multiprocessing itself loads __main__ in a worker
                self.modules.setdefault(name, path)
        elif (type(obj).__module__ or "").split(".")[0] == "torch":
            self.torch_state = True
        return NotImplemented  # pickle it as usual


class HoldsTorchState(Exception):
    """A reward that holds torch tensors or modules (:func:`pickle_reward` with ``torch_state=False``)."""


def pickle_reward(reward: Any, torch_state: bool = True) -> bytes:
    """The payload a worker loads ``reward`` from: the reward pickled, and the files of the modules
    its functions and classes come from, so that a worker loads a module it cannot import by name
    (a reward given as ``path/to/file.py:function``) from its file. Raises what ``pickle`` raises
    for an object that cannot be pickled (a lambda, a closure), and with ``torch_state=False``
    :class:`HoldsTorchState` for one that holds torch tensors or modules (a model on a GPU would be
    copied into the worker)."""
    buffer = io.BytesIO()
    pickler = _RecordingPickler(buffer)
    pickler.dump(reward)
    if pickler.torch_state and not torch_state:
        raise HoldsTorchState("it holds torch tensors or modules (a model), which a process of its own would copy")
    return pickle.dumps((pickler.modules, buffer.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that cannot be imported
        return False


def _load_reward(payload: bytes) -> Any:
    """The reward of a :func:`pickle_reward` payload, in a worker: modules it cannot import by name
    are first loaded from their files."""
    modules, pickled = pickle.loads(payload)
    for name, path in modules.items():
        if name in sys.modules or _importable(name):
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return pickle.loads(pickled)


# --------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _send(conn: Any, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def worker_main(conn: Any, payload: bytes) -> None:
    """Entry point of a worker process: load the reward (:func:`pickle_reward`'s ``payload``), then
    score tasks until told to stop. Tasks run in the process's main thread, where signal-based
    timeouts (``signal.alarm``, as Math-Verify's) work."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which stops us
    try:
        reward = _load_reward(payload)
    except BaseException:
        _send(conn, ("init_error", traceback.format_exc()))
        return
    _send(conn, ("ready", None))
    while True:
        try:
            task = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the trainer went away
            return
        if task is None:
            return
        task_id, kwargs = task
        try:
            value = reward(**kwargs)
            if inspect.isawaitable(value):  # an async reward in a pool: run it to completion here
                value = asyncio.run(_await(value))
            data = pickle.dumps(("ok", task_id, value), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # noqa: BLE001  (SystemExit from a reward is a failed sample too)
            data = pickle.dumps(
                ("error", task_id, (type(exc).__name__, str(exc), reward_traceback(exc))),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        conn.send_bytes(data)


# --------------------------------------------------------------------------------------------------
# Pool side
# --------------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, ctx: Any, payload: bytes, name: str):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(child, payload), name=name, daemon=True)
        self.process.start()
        child.close()
        self.state = "starting"  # starting | idle | busy
        self.task: int | None = None
        self.deadline = time.monotonic() + STARTUP_TIMEOUT

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.join(timeout=5)
        except Exception:  # noqa: BLE001  (already gone)
            pass
        self.conn.close()

    def exit_description(self) -> str:
        self.process.join(timeout=1)
        code = self.process.exitcode
        if code is None:
            return "closed its pipe"
        if code < 0:
            try:
                return f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"


@dataclass
class _Progress:
    """Where one :meth:`WorkerPool.run` stands: each task's result (None: not yet), the tasks no worker
    has picked up, how many have no result, and whether one failed."""

    results: list[tuple[str, Any] | None]
    pending: deque[int]
    remaining: int
    failed: bool = False

    def finish(self, task: int, result: tuple[str, Any]) -> None:
        self.results[task] = result
        self.remaining -= 1
        self.failed = self.failed or result[0] == "error"


class WorkerPool:
    """``size`` persistent worker processes that each hold one unpickled copy of a reward
    (``payload``: :func:`pickle_reward`'s).

    Not thread-safe: one :meth:`run` at a time (the scorer runs each pool from one thread).
    """

    def __init__(self, payload: bytes, size: int, name: str = "reward", start_method: str | None = None):
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self.payload = payload
        self.size = size
        self.name = name
        self.ctx = multiprocessing.get_context(start_method or default_start_method())
        self.workers: list[_Worker] = []
        self._started = 0

    def _start_worker(self) -> _Worker:
        self._started += 1
        worker = _Worker(self.ctx, self.payload, f"lit-grpo-reward-{self.name}-{self._started}")
        self.workers.append(worker)
        return worker

    def _remove(self, worker: _Worker) -> None:
        worker.kill()
        self.workers.remove(worker)

    def close(self) -> None:
        """Stop every worker: idle ones are asked to exit (and killed after a second), others killed."""
        workers, self.workers = self.workers, []
        for worker in workers:
            if worker.state == "idle":
                try:
                    _send(worker.conn, None)
                except Exception:  # noqa: BLE001  (already gone)
                    pass
            else:
                worker.process.kill()
        deadline = time.monotonic() + 1.0
        for worker in workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.kill()
            else:
                worker.conn.close()

    def run(
        self,
        tasks: list[bytes],
        timeout: float | None = None,
        stop_on_error: bool = False,
        cancel: threading.Event | None = None,
    ) -> list[tuple[str, Any] | None]:
        """Run pickled ``(task_id, kwargs)`` tasks (task ids are their positions); one result per task.

        A result is ``("ok", value)`` or ``("error", Failure)``. A task running longer than
        ``timeout`` seconds (measured from when a worker picks it up) fails with kind ``timeout``
        and its worker is killed and replaced; a worker that dies fails its task with kind
        ``crash``. With ``stop_on_error`` the first failure ends the run: busy workers are killed
        and unfinished tasks get ``None``. Setting ``cancel`` does the same and raises
        :class:`PoolCancelled`. Raises :class:`PoolInitError` if a worker cannot load the reward.
        """
        progress = _Progress([None] * len(tasks), deque(range(len(tasks))), len(tasks))
        try:
            while progress.remaining and not (stop_on_error and progress.failed):
                if cancel is not None and cancel.is_set():
                    raise PoolCancelled(f"scoring with reward {self.name!r} was cancelled")
                self._start_workers(len(progress.pending))
                self._hand_out(tasks, progress, timeout)
                if not self.workers:
                    continue
                for worker in self._wait_for_workers():
                    self._receive(worker, progress)
                self._stop_overdue(progress, timeout)
        except BaseException:
            self._abandon_busy()
            raise
        if progress.remaining:  # stopped early: the unfinished tasks' workers are busy with unwanted work
            self._abandon_busy()
        return progress.results

    def _start_workers(self, pending: int) -> None:
        """Start workers for work that no idle or starting worker will pick up."""
        waiting = sum(w.state in ("idle", "starting") for w in self.workers)
        for _ in range(min(pending - waiting, self.size - len(self.workers))):
            self._start_worker()

    def _hand_out(self, tasks: list[bytes], progress: _Progress, timeout: float | None) -> None:
        """Send each idle worker a pending task, its deadline ``timeout`` from now."""
        now = time.monotonic()
        for worker in self.workers:
            if worker.state == "idle" and progress.pending:
                index = progress.pending.popleft()
                try:
                    worker.conn.send_bytes(tasks[index])
                except (OSError, ValueError):  # died while idle: retry the task elsewhere
                    progress.pending.appendleft(index)
                    worker.state = "dead"
                    continue
                worker.state, worker.task = "busy", index
                worker.deadline = now + timeout if timeout is not None else float("inf")
        for worker in [w for w in self.workers if w.state == "dead"]:
            self._remove(worker)

    def _wait_for_workers(self) -> list[_Worker]:
        """The workers with a message or a death, waiting for one until the nearest deadline (at most
        :data:`_POLL` seconds)."""
        deadline = min(w.deadline for w in self.workers)
        wait = max(0.0, min(deadline - time.monotonic(), _POLL))
        ready = set(
            multiprocessing.connection.wait(
                [w.conn for w in self.workers] + [w.process.sentinel for w in self.workers], wait
            )
        )
        return [w for w in list(self.workers) if w.conn in ready or w.process.sentinel in ready]

    def _receive(self, worker: _Worker, progress: _Progress) -> None:
        """Act on what ``worker`` sent: it is ready, could not load the reward, or finished its task; or
        it died (its task fails with kind ``crash``)."""
        message = self._read(worker)
        if message is None:  # the process died (or closed its pipe)
            how = worker.exit_description()
            if worker.state == "starting":
                raise PoolInitError(f"a worker process for reward {self.name!r} {how} while loading the reward")
            if worker.state == "busy":
                progress.finish(worker.task, ("error", Failure("crash", "WorkerDied",
                                                               f"the worker process {how} while scoring this sample")))
            self._remove(worker)
            return
        kind = message[0]
        if kind == "ready":
            worker.state, worker.deadline = "idle", float("inf")
        elif kind == "init_error":
            raise PoolInitError(f"a worker process could not load reward {self.name!r}:\n{message[1]}")
        else:
            _, task_id, payload = message
            if kind == "ok":
                progress.finish(task_id, ("ok", payload))
            else:
                type_name, text, tb = payload
                progress.finish(task_id, ("error", Failure("exception", type_name, text, tb)))
            worker.state, worker.task, worker.deadline = "idle", None, float("inf")

    @staticmethod
    def _read(worker: _Worker) -> tuple | None:
        """The message ``worker`` sent, or None where its process died (or closed its pipe)."""
        try:
            if not worker.conn.poll():
                return None
            data = worker.conn.recv_bytes()
        except (EOFError, OSError):
            return None
        try:
            return pickle.loads(data)
        except Exception as exc:  # e.g. a value of a class this process lacks
            if worker.state != "busy":
                raise
            return "error", worker.task, (type(exc).__name__, f"the reward's result could not be unpickled: {exc}", "")

    def _stop_overdue(self, progress: _Progress, timeout: float | None) -> None:
        """Kill workers whose task ran out of time (it fails with kind ``timeout``); a worker that never
        finished starting is a :class:`PoolInitError`."""
        now = time.monotonic()
        for worker in list(self.workers):
            if worker.deadline > now:
                continue
            if worker.state == "starting":
                raise PoolInitError(
                    f"a worker process for reward {self.name!r} did not load the reward within "
                    f"{STARTUP_TIMEOUT:g} seconds"
                )
            if worker.state == "busy":
                progress.finish(worker.task, ("error", Failure("timeout", "TimeoutError",
                                                               f"no result within the {timeout:g} s timeout")))
                self._remove(worker)

    def _abandon_busy(self) -> None:
        """Kill workers that are busy (their results are no longer wanted) or still starting."""
        for worker in list(self.workers):
            if worker.state != "idle":
                self._remove(worker)

    def __repr__(self) -> str:
        alive = sum(w.process.is_alive() for w in self.workers)
        return f"WorkerPool({self.name!r}, size={self.size}, alive={alive}, pid={os.getpid()})"
