"""The event loop of a scorer's ``async def`` rewards (used by :mod:`lit_grpo.scoring.scorer`): one
loop for the scorer's life, in a daemon thread of its own, so that a client bound to a loop keeps
working between steps; each call awaited for at most the reward's ``timeout``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from typing import Any

__all__ = ["CallTimeout", "EventLoopThread", "await_call"]


class CallTimeout(Exception):
    """An async reward call ran past its ``timeout``."""

    def __init__(self, timeout: float):
        super().__init__(f"no result within the {timeout:g} s timeout")
        self.timeout = timeout


async def await_call(reward: Any, kwargs: dict[str, Any], timeout: float | None) -> Any:
    """Call an async reward and await it, for at most ``timeout`` seconds (:class:`CallTimeout`).

    The call runs as a task that is cancelled, not awaited, after the timeout, so a coroutine that
    ignores cancellation cannot hold the step up (it keeps running on the scorer's loop).
    """
    result = reward(**kwargs)
    if not inspect.isawaitable(result):
        return result
    task = asyncio.ensure_future(result)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # no "never retrieved" noise
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise CallTimeout(timeout)
    return task.result()


class EventLoopThread:
    """An asyncio loop running forever in a daemon thread; the scorer's async rewards run on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lit-grpo-async-rewards", daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1)
            await self.loop.shutdown_asyncgens()

        try:
            self.submit(shutdown()).result(timeout=2)
        except Exception:  # noqa: BLE001  (best effort)
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=2)
        if not self.thread.is_alive():
            self.loop.close()
