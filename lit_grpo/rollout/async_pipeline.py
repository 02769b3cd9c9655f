"""Asynchronous GRPO (``model.max_staleness: k``): train on generation batches sampled by weights
up to k optimizer steps old, while the next ones are scored.

A pipeline of generation batches, k-step-off as in NeMo-RL's one-step-off GRPO and prime-rl. At
training step n the module hands batch n's prompts to :meth:`RolloutPipeline.exchange`, which

1. samples them with the current weights (version V: the optimizer steps taken so far; an engine
   with weights of its own, vLLM, gets them first), and starts scoring them with the rewards in a
   background thread;
2. gives back the oldest batch of the pipeline, scored (the trainer waits for its rewards only if
   they are not ready: ``time/wait_for_samples``), with its group-relative advantages and reference
   log-probs: the batch handed in ``depth = k // (num_iterations * steps_per_generation)`` training
   steps before, sampled ``depth * num_iterations * steps_per_generation <= k`` optimizer steps ago.

The first ``depth`` training steps only fill the pipeline: they sample and score but take no
optimizer step (``trainer.max_steps`` still counts optimizer steps). The last ``depth`` batches of a
run are sampled and never trained. ``k = 0`` is not this module: the module's synchronous step runs.

What overlaps. The colocated engines (``lit``, ``transformers``, ``vllm``) sample with the trainer's
own devices and weights, so generation does not overlap training: the step samples batch n first,
then trains; what overlaps is the reward scoring of batch n (a background thread: the rewards'
worker processes, an HTTP verifier, code execution) with the training on batch n - depth and the
generation of batch n + 1, which pays for slow rewards. With the ``vllm_server`` backend the
sampling itself runs in the background thread (HTTP requests, no collective): at step n the trainer
waits until the servers have sampled what it sent the step before (``time/wait_for_samples``), pushes
the new weights (``time/wait_for_weights``), sends batch n and trains on batch n - depth while the
servers sample it. The background thread works on a CPU copy of each batch (made once, by the
trainer, queued on its stream without waiting): it never waits for the trainer's device.

Multi-turn rollouts (``model.tools``, ``model.environment``) enter the pipeline as single-turn ones
do, sampled in the step on every backend (``vllm_server`` too: each turn's seed is drawn from the
trainer's random state, which only the main thread may draw from for a resume to be exact): the step's
weights sample every turn, the tool calls and environment steps between the turns run there (the calls
of a turn concurrently, :func:`~lit_grpo.rollout.tools.calls.run_tool_calls`), and each environment is
built, stepped, its reward read and closed within the step. The background thread scores the ended
conversations; a checkpoint holds them as plain records (:func:`~lit_grpo.rollout.tools.multi_turn.conversation_record`),
restored, never sampled again.

Dynamic sampling (``model.dynamic_sampling``) runs at the step that trains a batch, whose rewards are
known then (:meth:`RolloutPipeline._scored`): its groups without signal are replaced by the prompts the
data loader gives in that step, sampled there with the current weights and scored by the scoring thread
after the batches handed in at earlier steps (:meth:`RolloutPipeline._extra_round`); the step's own batch
is started after them (step 1 after step 2), so that they do not wait for its job. They are drawn and
trained in one step, so no checkpoint holds one and the data position stays exact.

Failures. Every exception of the background job (a server lost or refusing a request, a reward that
raised) is the batch's ``failure``, never raised in the thread; the ranks agree on it at a point every
rank reaches (the start of the next step on servers, and where the batch would be trained), and every
rank raises :class:`RolloutFailed` (or the server's :class:`GenerationFailed`) there: the run
stops in one line, with the checkpoint of the previous step, which holds the batch: its prompts,
sampled again after the resume, or, when its scoring failed, its completions, scored again.

Staleness. Every row says which weights sampled it (``Rollout.weight_versions``); the staleness of a
trained row is ``policy_version - weight_version`` when its training starts, logged as
``async/staleness_mean`` and ``async/staleness_max``. A batch with a row older than k is dropped, not
trained, and counted (``async/dropped_stale``, samples, cumulative); it is not regenerated: its
prompts were drawn from the data loader in order, and sampling them again with newer weights would
cost a generation the trainer then waits for, which is what the pipeline is there to avoid. With a
fixed pipeline depth a batch is never older than k; the check guards the bound (a resume with a
smaller k drops the older batches the checkpoint holds).

Behaviour log-probs. The importance-sampling correction (``vllm_importance_sampling_correction``,
:mod:`lit_grpo.algorithm.sampling_correction`) reweights each sample by current policy / sampling policy. vLLM
returns its log-probs of the tokens it sampled; for the ``lit`` and ``transformers`` samplers the
policy's log-probs are computed right after sampling, with the weights that sampled
(``Rollout.sampling_logps``), so the same correction covers the staleness (one extra forward without
gradient per batch). The clipped ratio of the loss is then taken against the current policy, the
proximal policy of decoupled PPO.

Checkpoints. Lightning saves this callback's :meth:`state_dict` in every checkpoint: the batches in
the pipeline (prompts, columns, completions, rewards, the weight version of every row), every rank's,
gathered to rank 0, which writes it. A step's checkpoint waits for their sampling and scoring, and
resumes exactly; a signal's (:class:`~lit_grpo.run.preemption.CheckpointOnSignal`) waits a few seconds at
most, within the grace before the kill, then saves a batch not sampled yet as its prompts (sampled
after the resume) and one not scored yet as its rollout (scored after the resume). The data loader's
position is past their prompts, so a run resumed with ``--ckpt_path last`` trains each of them once
and hands none of them again.

The step axis. A batch's metrics (``reward``, ``rewards/*``, the completions) are logged at the step
that trains it, ``depth`` steps after the one that sampled it: the curves of a k-step-off run sit
``depth`` steps to the right of a synchronous run's.

Ranks. Every rank runs the same pipeline on its own prompts; the staleness and the drop of a batch
are decided over all ranks (its largest staleness on any rank), so no rank trains a batch another
has dropped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import lightning.pytorch as pl
import torch

from lit_grpo.data import PromptBatch
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.collector import RolloutCollector
from lit_grpo.rollout.dynamic_sampling import dynamic_sampling, next_prompt_batch
from lit_grpo.rollout.engines.base import agreed_failure
from lit_grpo.rollout.engines.server_lost import GenerationFailed
from lit_grpo.rollout.records import Rollout, SampledGroups, ScoredRollout
from lit_grpo.rollout.tools.multi_turn import conversation_from_record, conversation_record

__all__ = ["RolloutFailed", "RolloutPipeline", "check_async_settings"]


def check_async_settings(hp) -> None:
    """``model.max_staleness`` and the settings it cannot run with, naming the keys."""
    k = hp.max_staleness
    if k < 0:
        raise ConfigError(f"model.max_staleness must be at least 0 (0: synchronous), got {k}")
    if k == 0:
        return
    steps = hp.num_iterations * hp.steps_per_generation
    if k < steps:
        raise ConfigError(
            f"model.max_staleness ({k}) is below the optimizer steps of one generation batch (num_iterations * "
            f"steps_per_generation = {steps}): no batch could be trained one step late; use 0 or at least {steps}"
        )
    if not hp.vllm_importance_sampling_correction:
        # on every backend the behaviour weights are what corrects for the staleness (with one
        # optimizer step per batch the clipped ratio against the proximal policy is 1): off, stale
        # samples would be trained as if the current weights had drawn them
        raise ConfigError(
            f"model.vllm_importance_sampling_correction: false with model.max_staleness: {k} would train samples of "
            "weights up to k steps old as on-policy (the correction weighs them for the staleness on every backend): "
            "keep the correction on (its mode and bounds: model.vllm_importance_sampling_mode/_clip_min/_clip_max) "
            "or set model.max_staleness: 0"
        )


class RolloutFailed(GenerationFailed):
    """A batch of the asynchronous pipeline could not be sampled or scored in the background (a reward
    that raised, any error of the job), on this rank or another. Raised on every rank at the same point
    of the training step, before its first optimizer step, so that every rank writes the checkpoint of
    the previous step (:class:`~lit_grpo.rollout.engines.server_lost.CheckpointWhenServerLost`), which holds the
    batch's prompts: they are sampled again after the resume."""


def agree_on_background_failure(failure: BaseException | None, device: torch.device) -> None:
    """Raise on every rank when the background job of a batch failed on any (every rank calls it at the
    same point): a server's failure as it is (:class:`GenerationFailed`, a lost server among them),
    anything else as :class:`RolloutFailed` naming the rank and the error; either way every rank writes
    the checkpoint of the previous step."""
    if failure is not None and not isinstance(failure, GenerationFailed):
        wrapped = RolloutFailed(f"the background job of the asynchronous pipeline (model.max_staleness) failed on rank "
                                f"{torch.distributed.get_rank() if torch.distributed.is_initialized() else 0}: {type(failure).__name__}: {failure}")
        wrapped.__cause__, failure = failure, wrapped
    agreed_failure(failure, device)  # every rank raises the first failed rank's, with its message


@dataclass(eq=False)  # each batch is itself (the pipeline removes one by identity)
class InFlight:
    """One generation batch in the pipeline: sampled (or being sampled, on servers), its scoring under
    way or done; or, restored from a checkpoint, still to sample (``rollout`` None) or to score
    (``rewards_per_func`` None). What the background job reads and writes is on the CPU."""

    batch: PromptBatch
    timings: dict[str, float]
    rollout: Rollout | None = None  # on the CPU; weight_versions [N] and sampling_logps [N, C] set
    work: Future | None = None  # the background job: sampling on servers, then the rewards; fills the fields below
    sampled: threading.Event = field(default_factory=threading.Event)  # set once the rollout (or failure) is there
    failure: Exception | None = None  # the background job's (a server's error, a reward's), agreed on at a step
    completions: list | None = None
    rewards_per_func: torch.Tensor | None = None  # [N, K] on the CPU
    reward_errors: dict[str, int] | None = None  # samples each reward failed on (rewards/<name>/errors)
    copied: Any = None  # a torch.cuda.Event: the rollout's copies to the CPU are done (None: they are)

    def wait_sampled(self) -> float:
        """Wait until the batch is sampled (or failed); the seconds waited."""
        start = time.perf_counter()
        if self.work is not None:
            self.sampled.wait()
        return time.perf_counter() - start

    def finish(self, timeout: float | None = None) -> float:
        """Wait for the whole job (sampling on servers, rewards), at most ``timeout`` seconds (None: until
        it ends); the seconds waited."""
        if self.work is None:
            return 0.0
        start = time.perf_counter()
        done, _ = wait([self.work], timeout=timeout)
        if done:
            self.work.result()  # the job itself catches every exception: it is the batch's failure
            self.work = None
        return time.perf_counter() - start

    def state(self, timeout: float | None = None) -> dict[str, Any]:
        """Plain tensors, lists and numbers (a ``weights_only`` checkpoint), after waiting at most ``timeout``
        seconds for the job (None: until it ends). What is not done by then is saved as what is left to
        do: a batch not sampled yet (or whose sampling failed, on servers) as its prompts, sampled again
        after the resume; one sampled and not scored (not yet, or its scoring failed) as its rollout,
        scored after the resume. (So a colocated engine, whose sampling may be a collective, never
        samples a restored batch: its batches are always sampled when they enter the pipeline.)"""
        self.finish(timeout)
        if self.copied is not None:
            self.copied.synchronize()
        rollout = self.rollout  # assigned by the job once sampled
        scored = rollout is not None and self.work is None and self.failure is None
        if rollout is not None:
            rollout = {f.name: getattr(rollout, f.name) for f in fields(Rollout)}
            if rollout["conversations"] is not None:  # multi-turn: ended, their environments closed
                rollout["conversations"] = [conversation_record(c) for c in rollout["conversations"]]
        return {
            "prompts": self.batch.prompts,
            "columns": self.batch.columns,
            "rollout": rollout,
            "timings": dict(self.timings),
            "completions": self.completions if scored else None,
            "rewards_per_func": self.rewards_per_func if scored else None,
            "reward_errors": self.reward_errors if scored else None,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> InFlight:
        rollout = state["rollout"]
        if rollout is not None and rollout.get("conversations") is not None:
            rollout = {**rollout, "conversations": [conversation_from_record(c) for c in rollout["conversations"]]}
        return cls(
            batch=PromptBatch(prompts=state["prompts"], columns=state["columns"]),
            timings=state["timings"],
            rollout=Rollout(**rollout) if rollout is not None else None,
            completions=state["completions"],
            rewards_per_func=state["rewards_per_func"],
            reward_errors=state.get("reward_errors"),
        )


def rollout_on(rollout: Rollout, device: torch.device, non_blocking: bool = False) -> Rollout:
    """``rollout`` with every tensor on ``device`` (to the CPU with ``non_blocking``: into pinned memory,
    done once the copies queued on the current stream are)."""
    def moved(value):
        return value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value

    return Rollout(**{f.name: moved(getattr(rollout, f.name)) for f in fields(Rollout)})


def to_host(rollout: Rollout) -> tuple[Rollout, torch.cuda.Event | None]:
    """``rollout`` copied to the CPU once, for the background thread, without waiting for the device: the
    copies are queued on the trainer's stream, and the event returned (None off CUDA) is recorded after
    them, for the thread to wait on before it reads (then it never syncs with the trainer's stream)."""
    on_cuda = rollout.completion_ids.is_cuda
    host = rollout_on(rollout, torch.device("cpu"), non_blocking=on_cuda)
    if not on_cuda:
        return host, None
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


class RolloutPipeline(pl.Callback):
    """The batches sampled and not yet trained (see the module doc); a callback so that it is
    checkpointed, drained before validation (which shares the rewards) and stopped at the end."""

    def __init__(self, max_staleness: int, optimizer_steps_per_batch: int) -> None:
        self.max_staleness = max_staleness
        self.depth = max_staleness // optimizer_steps_per_batch  # batches in flight before one is trained
        self.in_flight: deque[InFlight] = deque()
        self.dropped_stale = 0  # samples (all ranks) not trained because they were older than max_staleness
        self.metrics: dict[str, torch.Tensor] = {}  # of the batch trained last, logged by the module
        self._executor: ThreadPoolExecutor | None = None
        self._to_restore: dict[str, Any] | None = None
        self._checkpoint_deadline: float | None = None  # until when a checkpoint waits for the jobs (None: their end)
        self._stopping = threading.Event()  # the run ends: jobs not scoring yet skip it

    @classmethod
    def for_settings(cls, hp) -> RolloutPipeline | None:
        check_async_settings(hp)
        return cls(hp.max_staleness, hp.num_iterations * hp.steps_per_generation) if hp.max_staleness else None

    # ------------------------------------------------------------------------------------------
    # The step
    # ------------------------------------------------------------------------------------------

    def exchange(self, module, batch: PromptBatch) -> tuple[ScoredRollout | None, list | None]:
        """Sample ``batch`` with the current weights and start scoring it; return the oldest batch
        of the pipeline scored and ready for the update (steps 1-4), or ``(None, None)`` while the
        pipeline fills (or when every batch in it was too old). With dynamic sampling ``batch`` starts
        after the oldest is ready: its extra rounds are scored behind the batches already in flight
        only, not behind this one's whole job (on servers, its sampling)."""
        self._restore(module)
        waited = 0.0
        if module.engine.samples_elsewhere:
            # The servers take new weights between two requests only: wait until what they sample for
            # the pipeline is done (the batch trained next, sampled while the last step trained), then
            # agree over the ranks that nothing failed, before anything of this step changes.
            for item in self.in_flight:
                waited += item.wait_sampled()
                agree_on_background_failure(item.failure if item.sampled.is_set() else None, module.device)
        wait_for_weights = 0.0
        if module.engine.holds_weights:
            wait_for_weights = module.collector.sync_weights()
        for item in self.in_flight:  # restored unsampled (sampled again first) or unscored (scored again)
            if item.work is None and item.rewards_per_func is None and item.failure is None:
                self.start(module, item)
        current = InFlight(batch, {"generate": 0.0, "rewards": 0.0, "logprobs": 0.0})
        start_first = not module.collector.settings.dynamic_sampling
        if start_first:
            self.start(module, current)
        self.in_flight.append(current)  # depth >= 1: the loop below never pops it
        ready, waited = self._oldest_ready(module, current, waited)
        if not start_first:
            self.start(module, current)
        if ready is None:
            return None, None
        scored, completions = ready
        scored.timings.update(wait_for_samples=waited, wait_for_weights=wait_for_weights)
        return scored, completions

    def _oldest_ready(self, module, current: InFlight, waited: float) -> tuple[tuple[ScoredRollout, list] | None, float]:
        """Pop the batches past the pipeline's depth, dropping those older than ``max_staleness``, and
        prepare the first that is not (:meth:`_scored`): it and its completions (None if none), and
        ``waited`` plus the seconds waited for their jobs. On a failure ``current`` leaves the pipeline."""
        while len(self.in_flight) > self.depth:
            item = self.in_flight.popleft()
            waited += item.finish()
            try:  # every rank pops as many batches: a failure anywhere (an extra round's too) stops every rank here
                agree_on_background_failure(item.failure, module.device)
                staleness = module.policy_version - item.rollout.weight_versions.to(module.device)  # [N]
                reduce = module.trainer.strategy.reduce
                if reduce(staleness.max().float(), reduce_op="max") > self.max_staleness:
                    self.dropped_stale += int(reduce(torch.tensor(float(len(staleness)), device=module.device), reduce_op="sum"))
                    continue
                scored, completions, reward_errors = self._scored(module, item)
            except BaseException:
                self.in_flight.appendleft(item)  # its prompts (and any batch after it) stay in the checkpoint
                self.in_flight.remove(current)  # the data loader gives this step's batch (and extra rounds') again
                raise
            self.metrics = self._metrics(module, scored.rollout, reward_errors)
            return (scored, completions), waited
        return None, waited

    def _metrics(self, module, rollout: Rollout, reward_errors: dict[str, int]) -> dict[str, torch.Tensor]:
        """``async/*`` of the rows trained (with dynamic sampling, those its rounds kept: the extra rounds'
        are the current weights'), and ``rewards/<name>/errors`` of the batch trained, not the one scored now."""
        reduce = module.trainer.strategy.reduce
        staleness = module.policy_version - rollout.weight_versions.to(module.device)  # [N]
        count = reduce(torch.tensor(float(len(staleness)), device=module.device), reduce_op="sum")
        metrics = {
            "async/staleness_mean": reduce(staleness.sum().float(), reduce_op="sum") / count,
            "async/staleness_max": reduce(staleness.max().float(), reduce_op="max"),
            "async/dropped_stale": torch.tensor(float(self.dropped_stale)),
            "async/batches_in_flight": torch.tensor(float(len(self.in_flight))),
        }
        for name in module.scorer.names:  # every rank reduces each
            errors = torch.tensor(float(reward_errors.get(name, 0)), device=module.device)
            metrics[f"rewards/{name}/errors"] = reduce(errors, reduce_op="sum")
        return metrics

    def start(self, module, item: InFlight, in_step: bool = False) -> None:
        """Sample ``item`` unless it is (on servers, without tools, and unless ``in_step``: in the
        background) and score it in the background. The background thread gets the rollout on the CPU
        and never touches the trainer's device. A multi-turn rollout is sampled in the step on every
        backend: its turns' seeds come from the trainer's random state, its tools and environments
        live and end within the step, and the background thread scores the ended conversations."""
        item.sampled.clear()
        item.failure = None
        sample = None
        if item.rollout is None and module.engine.samples_elsewhere and module.collector.tool_use is None and not in_step:
            sample = module.collector.background_sampler(item.batch)  # draws the seed now; its rollout on the CPU
        elif item.rollout is None:
            start = time.perf_counter()
            rollout = module.generate(item.batch.prompts, columns=item.batch.columns)
            item.timings["generate"] = time.perf_counter() - start
            if rollout.sampling_logps is None:  # the policy sampled: its log-probs now are the sampling weights'
                start = time.perf_counter()
                rollout.sampling_logps = module.logprobs.logps_no_grad(module.policy, rollout)  # [N, C]
                if rollout.tool_mask is not None:  # tool messages: not the policy's, 0 as the engines give them
                    rollout.sampling_logps = rollout.sampling_logps * rollout.tool_mask
                item.timings["logprobs"] = time.perf_counter() - start
            item.rollout, item.copied = to_host(rollout)
        item.work = self._thread().submit(self._sample_and_score, module.collector, item, sample, self._stopping)

    @staticmethod
    def _sample_and_score(collector: RolloutCollector, item: InFlight, sample, stopping: threading.Event) -> None:
        """In the background thread (no collective, nothing on the trainer's device): on servers the
        sampling, then the rewards. Every exception is the batch's ``failure``, agreed on by every rank
        when the batch is trained (``exchange``), never raised here."""
        try:
            if item.copied is not None:
                item.copied.synchronize()  # the rollout's copies to the CPU are done
            if sample is not None:
                start = time.perf_counter()
                rollout, failure = sample(stopping)  # the run's end stops it (teardown waits for this job)
                item.timings["generate"] = time.perf_counter() - start
                if failure is not None:
                    raise failure
                item.rollout = rollout
        except Exception as error:  # noqa: BLE001 - the batch's failure, raised on every rank at a step
            item.failure = error
        finally:
            item.sampled.set()
        if item.failure is not None or stopping.is_set():
            return
        try:
            start = time.perf_counter()
            item.completions, rewards_per_func = collector.score(collector.scorer, item.batch, item.rollout,
                                                                 collector.settings.num_generations, device=torch.device("cpu"))
            item.reward_errors = dict(collector.scorer.last_error_counts)
            item.rewards_per_func = rewards_per_func
            item.timings["rewards"] = time.perf_counter() - start
        except Exception as error:  # noqa: BLE001
            item.failure = error

    def _scored(self, module, item: InFlight) -> tuple[ScoredRollout, list, dict[str, int]]:
        """Steps 3-4 of a sampled and scored batch, as in the synchronous step: advantages from every
        rank's rewards (the collector's), with dynamic sampling its extra rounds (:meth:`_extra_round`),
        then the loss mask, the dapo normaliser and the reference log-probs (``GRPOModule.prepare_update``).
        The scored batch, its completions as the rewards saw them, and the samples each reward failed on."""
        timings, reward_errors = dict(item.timings), dict(item.reward_errors or {})  # None: a checkpoint without counts
        sampled = self._groups(module, item)
        statistics = None
        if module.collector.settings.dynamic_sampling:
            def sample_more(batch: PromptBatch, _: dict) -> SampledGroups:
                extra = self._extra_round(module, batch)
                for name, value in extra.timings.items():
                    timings[name] = timings.get(name, 0.0) + value
                for name, errors in (extra.reward_errors or {}).items():
                    reward_errors[name] = reward_errors.get(name, 0) + errors
                return self._groups(module, extra)

            sampled, statistics = dynamic_sampling(module.collector, sampled, timings, lambda: next_prompt_batch(module.trainer),
                                                   sample_more)
        scored = module.prepare_update(sampled, timings)
        scored.dynamic_sampling = statistics
        return scored, sampled.completions, reward_errors

    def _extra_round(self, module, batch: PromptBatch) -> InFlight:
        """One extra round of dynamic sampling for the batch about to be trained: prompts the data loader
        gives now (so the checkpoint of this step counts them), sampled now with the current weights, in
        the step on every backend, and scored by the scoring thread after the batches handed in before
        (one scoring at a time); every rank agrees on how it ended."""
        extra = InFlight(batch, {"generate": 0.0, "rewards": 0.0, "logprobs": 0.0})
        self.start(module, extra, in_step=True)
        extra.finish()
        agree_on_background_failure(extra.failure, module.device)
        return extra

    def _groups(self, module, item: InFlight) -> SampledGroups:
        """Step 3 of a sampled and scored batch on the trainer's device (the collector's advantages)."""
        rollout = rollout_on(item.rollout, module.device)
        rewards_per_func = item.rewards_per_func.to(module.device)  # [N, K]
        return module.collector.groups(item.batch, rollout, item.completions, rewards_per_func)

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:  # one thread: batches are scored in order, one at a time
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit-grpo-scoring")
        return self._executor

    def drain(self) -> None:
        """Finish every scoring under way (before validation, which shares the rewards)."""
        for item in self.in_flight:
            item.finish()

    # ------------------------------------------------------------------------------------------
    # Checkpoints and the run's end
    # ------------------------------------------------------------------------------------------

    @contextmanager
    def checkpoint_waiting_at_most(self, seconds: float) -> Iterator[None]:
        """Inside, a checkpoint waits at most ``seconds`` in all for the jobs in flight (a signal's, within
        the grace before the kill); what is not done by then is saved as what is left to do
        (:meth:`InFlight.state`). Outside, a checkpoint waits until they end, so that it resumes exactly."""
        self._checkpoint_deadline = time.monotonic() + seconds  # one deadline for every state_dict inside
        try:
            yield
        finally:
            self._checkpoint_deadline = None

    def state_dict(self) -> dict[str, Any]:
        """Every rank's batches in flight, gathered to rank 0, which writes the checkpoint (called on every
        rank while a checkpoint is written: the others' state holds none). Before the first step after a
        resume, the state restored, not yet shared out (a checkpoint then loses none of it)."""
        if self._to_restore is not None:
            return self._to_restore
        deadline = self._checkpoint_deadline  # a checkpoint may be written twice (top-k and last): waited for once
        states = [item.state(None if deadline is None else max(0.0, deadline - time.monotonic())) for item in self.in_flight]
        per_rank: list[Any] | None = [states]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            writer = torch.distributed.get_rank() == 0
            per_rank = [None] * torch.distributed.get_world_size() if writer else None
            torch.distributed.gather_object(states, per_rank, dst=0)
        return {"per_rank": per_rank, "dropped_stale": self.dropped_stale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """At the start of a resumed run (before validation or any step): its batches are shared out by rank."""
        world_size = torch.distributed.get_world_size() if torch.distributed.is_available() and torch.distributed.is_initialized() else 1
        if len(state_dict["per_rank"]) != world_size:
            raise ConfigError(
                f"the checkpoint holds the asynchronous pipeline (model.max_staleness) of {len(state_dict['per_rank'])} "
                f"process(es) and this run has {world_size}: their sampled batches cannot be shared out; resume "
                f"with {len(state_dict['per_rank'])} process(es)"
            )
        self._to_restore = state_dict

    def _restore(self, module) -> None:
        state = self._to_restore
        if state is None:
            return
        self._to_restore = None
        self.in_flight = deque(InFlight.from_state(item) for item in state["per_rank"][module.global_rank])
        self.dropped_stale = state["dropped_stale"]

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.drain()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stop the background thread: the batches not started are dropped, one still sampling is not
        scored, and the one scoring is waited for (a reward cannot be interrupted)."""
        if self._executor is not None:
            self._stopping.set()
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
            self._stopping = threading.Event()
