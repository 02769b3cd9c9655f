"""Code that tests/run/test_resume.py runs in other processes (kept light: no transformers import).

- :class:`SigkillDuringStep`, a callback that SIGKILLs its own training process in the middle of a
  step, configured in the YAML of a ``lit-grpo fit`` run (``class_path: resume_helpers.SigkillDuringStep``,
  with ``tests/`` on ``PYTHONPATH``). SIGKILL cannot be caught: no ``finally``, no ``on_exception``, no
  flushing of the logger, exactly like the OOM killer or a preempted node.
- :class:`SignalDuringStep`, likewise, sends a catchable signal (SIGTERM, SIGUSR1, ...) to one rank
  in the middle of a step (tests/run/test_preemption.py).
- :func:`gather_rng_states_on_rank`, one of two gloo processes checking that ``RNGStateCheckpoint``
  gathers every rank's random states and that each rank restores its own.
"""

import os
import signal
from types import SimpleNamespace

import torch
from lightning.pytorch.callbacks import Callback

from lit_grpo.run.checkpointing import RNGStateCheckpoint


class SigkillDuringStep(Callback):
    """Kill the process just before the optimizer step that would make ``global_step`` exceed ``after_step``.

    That step's completions have been sampled and scored and its gradients computed, and the
    checkpoint of ``after_step`` (written at the end of the previous training step) is on disk.
    """

    def __init__(self, after_step: int) -> None:
        self.after_step = after_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.after_step:
            # TensorBoard writes events from a queue; flush what the finished steps logged so that
            # the test can read them (the resume does not depend on it).
            trainer.logger.experiment.flush()
            os.kill(os.getpid(), signal.SIGKILL)


class SignalDuringStep(Callback):
    """Send ``signal_name`` to this process (rank ``rank`` only) just before the optimizer step that
    would make ``global_step`` exceed ``after_step``: in the middle of a training step, as a scheduler's
    or a cloud's signal arrives, delivered by the kernel like any ``kill``."""

    def __init__(self, signal_name: str, after_step: int, rank: int = 0) -> None:
        self.signal_name, self.after_step, self.rank = signal_name, after_step, rank

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.after_step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), getattr(signal, self.signal_name))


def gather_rng_states_on_rank(rank: int, init_file: str, out_file: str) -> None:
    """Seed by rank, gather the states with the callback (a collective), restore, check this rank's stream."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(100 + rank)
        own_next = torch.rand(4)
        torch.manual_seed(100 + rank)
        per_rank = RNGStateCheckpoint().state_dict()["per_rank"]
        torch.rand(4)  # the run goes on
        resumed = RNGStateCheckpoint()
        resumed.load_state_dict({"per_rank": per_rank})
        resumed.on_train_start(SimpleNamespace(world_size=2, global_rank=rank), None)
        if not torch.equal(torch.rand(4), own_next):
            raise AssertionError(f"rank {rank} did not restore its own random stream")
        if rank == 0:
            torch.save(per_rank, out_file)
    finally:
        torch.distributed.destroy_process_group()
