"""A callback for tests/rollout/test_vllm_server.py: the vLLM server dies while the trainer samples.

With ``KILL_VLLM_SERVER_PID`` set, at optimizer step ``KILL_VLLM_SERVER_AT_STEP`` that server's process
group (the last of ``model.vllm_server_urls``) is killed, on every rank, after the step pushed its
weights and before it samples; without the variable (the resumed run) it does nothing.
"""

from __future__ import annotations

import os
import signal
import time

import lightning.pytorch as pl


class KillServerWhileSampling(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module, batch, batch_idx: int) -> None:
        pid = os.environ.get("KILL_VLLM_SERVER_PID")
        if not pid or trainer.global_step != int(os.environ["KILL_VLLM_SERVER_AT_STEP"]):
            return
        engine = pl_module.engine
        generate = engine.generate

        def killing_first(*args, **kwargs):
            engine.generate = generate
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:  # another rank killed it first
                pass
            while engine.servers[-1].answers():
                time.sleep(0.1)
            return generate(*args, **kwargs)

        engine.generate = killing_first


class KillServerWhileSamplingInTheBackground(pl.Callback):
    """The same for ``model.max_staleness`` (lit_grpo.rollout.async_pipeline): at optimizer step
    ``KILL_VLLM_SERVER_AT_STEP`` the server dies as the step hands its batch to the servers, so that the
    batch's sampling in the background fails and the next step stops the run."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module, batch, batch_idx: int) -> None:
        pid = os.environ.get("KILL_VLLM_SERVER_PID")
        if not pid or trainer.global_step != int(os.environ["KILL_VLLM_SERVER_AT_STEP"]):
            return
        engine = pl_module.engine
        sampler = engine.sampler

        def killing_first(*args, **kwargs):
            engine.sampler = sampler
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
            while engine.servers[-1].answers():
                time.sleep(0.1)
            return sampler(*args, **kwargs)

        engine.sampler = killing_first
