"""One benchmark run of lit-grpo or TRL's ``GRPOTrainer``, meant to run in its own process.

    python -m bench.trainer_runs SPEC.json RESULT.json

``SPEC.json`` is a :class:`RunSpec` as JSON. The run trains ``spec.steps`` optimizer steps (one per
generation batch on both trainers) and writes a :class:`RunResult` as JSON: per step the wall time,
the completion lengths, the mean reward and the phase split each trainer exposes, plus the process's
peak resident memory. One process per run, so peak memory is that run's alone.

Both trainers get identical work: the same model directory, the same prompts, the same reward
function (``spec.reward``: ``char_fraction`` of ``lit_grpo_rewards``, or ``even_token_fraction`` for
random models with a real vocabulary; wrapped to record prompt and completion token counts), the
same sampling and loss settings and a fused AdamW with the same learning rate, on ``spec.device``
(the CPU, or one CUDA GPU: then the peak GPU memory of the process is recorded too).

How a step is timed: the wall time between consecutive "optimizer step finished" callbacks
(Lightning's ``on_train_batch_end``, the Hugging Face ``on_step_end``), so every per-step overhead of
each trainer (logging, data loading, callbacks) is inside some step. The first step is timed from the
start of training.

With ``spec.count_matmuls`` one extra step runs after the timed ones under a
``TorchDispatchMode`` that adds up matmul FLOPs by the dtype of the operands actually multiplied
(after autocast): it proves whether bf16 runs bf16 matmuls, and how many FLOPs each trainer executes
against the floor of ``bench/flops.py``. That step is not timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class RunSpec:
    """Everything one run needs; the same spec is given to both trainers."""

    trainer: str  # "lit-grpo" | "trl"
    model_dir: str
    data_file: str
    steps: int  # timed generation batches, warm-up included (num_iterations optimizer steps each); the drivers drop the warm-up
    num_generations: int = 8
    prompts_per_step: int = 8
    max_completion_length: int = 32
    fixed_length: bool = False  # suppress EOS: every completion is exactly max_completion_length tokens
    beta: float = 0.0
    num_iterations: int = 1  # passes over each generation batch (the GRPO paper's mu), both trainers
    steps_per_generation: int = 1  # optimizer steps per pass, each on 1/S of the completions, both trainers
    precision: str = "fp32"  # "fp32" | "bf16" (autocast, float32 weights)
    device: str = "cpu"  # "cpu" | "cuda" (one GPU)
    reward: str = "char_fraction"  # a key of RECORDED_REWARDS
    learning_rate: float = 1e-5
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    temperature: float = 1.0
    seed: int = 0
    count_matmuls: bool = False  # one extra, untimed step that counts matmul FLOPs by dtype
    profile_ops: bool = False  # one extra, untimed step with every operator timed (bench/profile_step.py)
    threads: int | None = None  # torch.set_num_threads; None keeps torch's default (one per core)
    lit_options: dict = field(default_factory=dict)  # extra GRPOModule arguments (the ablations in git history at d59a9c4), lit-grpo only
    lit_code_dir: str | None = None  # import lit_grpo from this checkout instead of the installed one (d59a9c4's bench/ablation.py --against-commit)
    lit_full_logits: bool = False  # lit-grpo only: log-probs from the model's full logits, never the fused LM head (bench/long_completions.py)
    record_weight_change: bool = False  # keep a copy of the trainable weights to report how far training moved them


@dataclass
class StepRecord:
    step: int
    seconds: float
    cpu_seconds: float  # user + system CPU time of the process (all threads) during the step
    prompt_lengths: list[int]  # per completion, in tokens
    completion_lengths: list[int]  # per completion, real tokens including EOS
    reward: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds by phase, as the trainer reports them
    minor_faults: int | None = None  # page faults of the process during the step (fresh memory touched)
    loss: float | None = None  # the trainer's logged loss of the step (its last optimizer step's)


@dataclass
class RunResult:
    spec: dict
    steps: list[StepRecord]
    setup_seconds: float  # process start to the first step (imports, model loading, trainer setup)
    rss_before_training_mib: float
    peak_rss_mib: float
    torch_threads: int
    matmul_flops_by_dtype: dict[str, float] | None  # from the counted step
    counted_step_completion_lengths: list[int] | None
    counted_step_prompt_lengths: list[int] | None
    op_profile: dict | None = None  # from the profiled step (:class:`OpTimer`)
    peak_gpu_memory_gib: float | None = None  # torch.cuda.max_memory_allocated of the process (device "cuda")
    trainable_dtypes: list[str] | None = None  # dtypes of the weights the optimizer updates
    max_weight_change: float | None = None  # largest |after - before| of a trainable weight (record_weight_change)


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------

PROCESS_START = time.perf_counter()


class LengthRecorder:
    """Token counts of the completions scored since the last :meth:`take`."""

    def __init__(self) -> None:
        self.prompt_lengths: list[int] = []
        self.completion_lengths: list[int] = []
        self.rewards: list[float] = []

    def take(self) -> tuple[list[int], list[int], float]:
        out = self.prompt_lengths, self.completion_lengths, self.rewards
        self.prompt_lengths, self.completion_lengths, self.rewards = [], [], []
        mean_reward = sum(out[2]) / len(out[2]) if out[2] else float("nan")
        return out[0], out[1], mean_reward


RECORDER = LengthRecorder()
TOKENIZER = None  # set by the runner; counts prompt tokens exactly as both trainers tokenize them


def record(prompts, completion_ids, scores) -> list:
    """Record each completion's prompt and completion length and its reward; returns ``scores``."""
    RECORDER.prompt_lengths += [len(TOKENIZER(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    RECORDER.completion_lengths += [len(ids) for ids in completion_ids]
    RECORDER.rewards += [s for s in scores if s is not None]
    return scores


def recorded_char_fraction(prompts, completions, completion_ids, target=None, **kwargs):
    """``lit_grpo_rewards``' ``char_fraction`` (the quickstart reward: the fraction of the completion's
    characters in the ``target`` column), recorded."""
    from lit_grpo_rewards.text import char_fraction

    return record(prompts, completion_ids, char_fraction(completions=completions, target=target))


def even_token_fraction(completion_ids) -> list[float]:
    """The fraction of a completion's tokens with an even id: a reward the completions of a random model
    with a real vocabulary differ in (most of its tokens decode to no text, so text rewards are all 0
    and every group would be skipped as having no gradient)."""
    return [sum(token % 2 == 0 for token in ids) / max(len(ids), 1) for ids in completion_ids]


def recorded_even_token_fraction(prompts, completions, completion_ids, **kwargs):
    """:func:`even_token_fraction`, recorded."""
    return record(prompts, completion_ids, even_token_fraction(completion_ids))


RECORDED_REWARDS = {"char_fraction": recorded_char_fraction, "even_token_fraction": recorded_even_token_fraction}


def peak_rss_mib() -> float:
    """Peak resident set size of this process (VmHWM), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def minor_page_faults() -> int:
    """Minor page faults of this process so far: each is a page of fresh memory touched for the first time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def current_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class MatmulCounter:
    """A ``TorchDispatchMode`` adding up matmul FLOPs by operand dtype.

    It sits below autocast in the dispatcher, so it sees the dtypes the kernels really multiply.
    Counts ``mm``, ``addmm``, ``bmm``, ``baddbmm`` (torch's own FLOP formulas) and the CPU fused
    attention kernel (``4 * B * H * Lq * Lk * D`` forward, twice that backward)."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        aten = torch.ops.aten
        counts: dict[str, float] = defaultdict(float)
        formulas = {op: flop_registry[op] for op in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)}
        flash_cpu = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        flash_cpu_backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                packet = func.overloadpacket
                if packet in formulas:
                    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2)
                    counts[str(dtype).removeprefix("torch.")] += formulas[packet](*args, **kwargs, out_val=out)
                elif packet is flash_cpu or packet is flash_cpu_backward:
                    # forward (query, key, value, ...); backward (grad_out, query, key, value, ...)
                    query, key = (args[0], args[1]) if packet is flash_cpu else (args[1], args[2])
                    batch, heads, q_len, head_dim = query.shape
                    flops = 4 * batch * heads * q_len * key.shape[-2] * head_dim
                    counts[str(query.dtype).removeprefix("torch.")] += flops * (1 if packet is flash_cpu else 2)
                return out

        self.counts = counts
        self.mode = _Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


MATRIX_PRODUCT_OPS = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}
COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::index", "aten::index_select"}
OP_CATEGORIES = ("matrix products", "copies and casts", "other operators", "outside operators", "timer overhead")


def op_category(name: str) -> str:
    """Which part of a step an operator's time belongs to."""
    if name in MATRIX_PRODUCT_OPS:
        return "matrix products"
    if name in COPY_OPS:
        return "copies and casts"
    return "other operators"


def split_step_time(
    wall_seconds: float, ops: list[tuple[str, float, int]], seconds_per_call: float = 0.0, top: int = 25
) -> dict:
    """A timed step's wall time by :data:`OP_CATEGORIES` from ``(name, seconds, calls)`` per operator.

    The timer's own cost, ``seconds_per_call`` for each operator call, is ``timer overhead``; the rest
    of the wall time outside operators (Python, the frameworks, the dispatcher above the kernels) is
    ``outside operators``. Also the ``top`` operators by time."""
    seconds = dict.fromkeys(OP_CATEGORIES, 0.0)
    for name, op_seconds, _ in ops:
        seconds[op_category(name)] += op_seconds
    seconds["timer overhead"] = seconds_per_call * sum(calls for _, _, calls in ops)
    seconds["outside operators"] = max(wall_seconds - sum(seconds.values()), 0.0)
    ranked = sorted(ops, key=lambda op: -op[1])
    return {
        "wall_seconds": wall_seconds,
        "seconds_by_category": seconds,
        "top_ops": [{"name": n, "seconds": t, "calls": c} for n, t, c in ranked[:top]],
    }


class OpTimer:
    """Times every ATen operator call of one step, below autograd and autocast (a
    ``TorchDispatchMode``, as :class:`MatmulCounter`), so the backward pass and autocast's casts are
    seen as the kernels that run; :attr:`summary` is :func:`split_step_time` of it.

    Chosen over ``torch.profiler``, under which TRL touched far more fresh memory: its
    profiled step (4M, fixed length 128, bf16) touched 648,523 fresh pages against 66,171 per timed
    step, and its copies took 4.33 s; under this timer 8,358 pages and 0.65 s. The timer's cost per call is
    measured on a cheap operator before the step and reported as ``timer overhead``."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        seconds: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                start = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                name = f"{func.namespace}::{func.overloadpacket.__name__}"
                seconds[name] += time.perf_counter() - start
                calls[name] += 1
                return out

        self.seconds, self.calls, self.mode = seconds, calls, _Mode()
        self.seconds_per_call = self._overhead_per_call()
        seconds.clear()  # the calibration's calls
        calls.clear()
        self.summary: dict | None = None

    def _overhead_per_call(self, n: int = 3000) -> float:
        """Wall time the mode adds to one call of a cheap operator (median of 5 rounds)."""
        import torch

        x = torch.zeros(1)
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                torch.neg(x)
            bare = time.perf_counter() - start
            with self.mode:
                start = time.perf_counter()
                for _ in range(n):
                    torch.neg(x)
                timed = time.perf_counter() - start
            rounds.append(max(timed - bare, 0.0) / n)
        return sorted(rounds)[len(rounds) // 2]

    def __enter__(self):
        self.start, self.start_faults = time.perf_counter(), minor_page_faults()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        wall, faults = time.perf_counter() - self.start, minor_page_faults() - self.start_faults
        ops = [(name, self.seconds[name], self.calls[name]) for name in self.seconds]
        self.summary = split_step_time(wall, ops, self.seconds_per_call)
        self.summary.update(minor_faults=faults, timer_seconds_per_call=self.seconds_per_call)
        return False


# ----------------------------------------------------------------------------------------------
# lit-grpo
# ----------------------------------------------------------------------------------------------


def run_lit_grpo(spec: RunSpec) -> RunResult:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.loggers.logger import rank_zero_experiment

    import lit_grpo
    from lit_grpo.data import GRPODataModule
    from lit_grpo.plugins import register_plugin
    from lit_grpo.train.module import GRPOModule

    reward = RECORDED_REWARDS[spec.reward]

    class BenchRewardPlugin:
        """Registers the recording reward through lit-grpo's public plugin API."""

        @lit_grpo.hookimpl
        def register_rewards(self, register):
            register(reward)

    register_plugin(BenchRewardPlugin(), name="bench", package="bench")
    if spec.lit_full_logits:  # every model's head refused, as for a model type not known to have a linear head
        import lit_grpo.models

        lit_grpo.models.output_head = lambda model: "full logits (the bench's lit_full_logits)"

    class FixedLengthGRPOModule(GRPOModule):
        """Samples exactly ``max_completion_length`` tokens: EOS suppressed by ``min_new_tokens``."""

        def configure_model(self) -> None:
            super().configure_model()
            self.generation_config.min_new_tokens = self.hparams.max_completion_length

    class DiscardingLogger(Logger):
        """Receives every logged metric, as a real logger does, and keeps nothing (TRL runs with
        ``report_to='none'``)."""

        @property
        def name(self) -> str:
            return "discard"

        @property
        def version(self) -> int:
            return 0

        @property
        @rank_zero_experiment
        def experiment(self):
            return None

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            pass

    recorder = RecordingCallback.for_lightning(spec.steps, spec.count_matmuls, spec.profile_ops, spec.record_weight_change)

    module_class = FixedLengthGRPOModule if spec.fixed_length else GRPOModule
    module_options = dict(
        model_name_or_path=spec.model_dir,
        rewards=[{"name": reward.__name__}],
        num_generations=spec.num_generations,
        max_completion_length=spec.max_completion_length,
        temperature=spec.temperature,
        top_p=1.0,
        top_k=0,
        num_iterations=spec.num_iterations,
        steps_per_generation=spec.steps_per_generation,
        micro_batch_size=None,
        loss_type="dapo",
        beta=spec.beta,
        epsilon=spec.epsilon,
        epsilon_high=spec.epsilon_high,
        scale_rewards="group",
        max_grad_norm=1.0,
        log_completions_every_n_steps=0,
        save_completions=False,  # TRL runs with log_completions=False
        optimizer=lambda params: torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=0.0, fused=True),
    )
    module = module_class(**{**module_options, **spec.lit_options})  # lit_options may override the settings above
    global TOKENIZER
    TOKENIZER = module.tokenizer
    data = GRPODataModule(
        path="json", data_files=spec.data_file, prompt_column="prompt", batch_size=spec.prompts_per_step, seed=spec.seed
    )
    pl.seed_everything(spec.seed, verbose=False)
    trainer = pl.Trainer(
        accelerator="gpu" if spec.device == "cuda" else "cpu",
        devices=1,
        # ``steps`` counts generation batches; max_steps counts optimizer steps
        max_steps=(spec.steps + recorder.extra_steps) * module.hparams.num_iterations * module.hparams.steps_per_generation,
        precision="bf16-mixed" if spec.precision == "bf16" else "32-true",
        logger=DiscardingLogger(),
        log_every_n_steps=1,
        callbacks=[recorder],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    return recorder.result(spec)


class RecordingCallback:
    """Times optimizer steps, takes the recorded token counts, and runs the matmul counter and the
    operator timer on the extra steps; shared by the Lightning and the Hugging Face callback
    adapters below. It also notes what training did to the model it is given at the start: the
    trainable weights' dtypes and, with ``record_weight_change``, how far they moved."""

    def __init__(self, recorded_steps: int, count_matmuls: bool, profile_ops: bool = False, record_weight_change: bool = False) -> None:
        """The first ``recorded_steps`` steps are timed (warm-up included); then, each on a step of its
        own, the matmul counter (``count_matmuls``) and the operator timer (``profile_ops``)."""
        self.recorded_steps = recorded_steps
        self.record_weight_change = record_weight_change
        self.model = None  # the trained model, given at the start of training
        self.initial_weights: dict[str, object] | None = None  # its trainable weights then, on the CPU
        self.instruments = ["count_matmuls"] * count_matmuls + ["profile_ops"] * profile_ops
        self.extra_steps = len(self.instruments)  # steps the trainer runs after the timed ones
        self.records: list[StepRecord] = []
        self.completed_steps = 0
        self.last_time: float | None = None
        self.last_cpu_time: float | None = None
        self.last_faults = 0
        self.counter: MatmulCounter | None = None
        self.counted_lengths: tuple[list[int], list[int]] | None = None
        self.timer: OpTimer | None = None
        self.active = None  # the instrument around the running step
        self.setup_seconds = float("nan")
        self.rss_before_training = float("nan")

    def train_start(self, model=None) -> None:
        import torch

        self.model = model
        if model is not None and self.record_weight_change:
            self.initial_weights = {name: w.detach().to("cpu", torch.float32, copy=True) for name, w in trainable_weights(model)}
        self.last_time = time.perf_counter()
        self.last_cpu_time = time.process_time()
        self.last_faults = minor_page_faults()
        self.setup_seconds = self.last_time - PROCESS_START
        self.rss_before_training = current_rss_mib()
        RECORDER.take()

    def step_start(self) -> None:
        extra = self.completed_steps - self.recorded_steps
        if 0 <= extra < len(self.instruments):
            if self.instruments[extra] == "count_matmuls":
                self.active = self.counter = MatmulCounter()
            else:
                self.active = self.timer = OpTimer()
            self.active.__enter__()

    def step_end(self, phases: dict[str, float] | None = None, loss: float | None = None) -> None:
        now, cpu_now, faults_now = time.perf_counter(), time.process_time(), minor_page_faults()
        step_index = self.completed_steps
        self.completed_steps += 1
        prompt_lengths, completion_lengths, reward = RECORDER.take()
        if self.active is not None:
            self.active.__exit__(None, None, None)
            if self.active is self.counter:
                self.counted_lengths = (prompt_lengths, completion_lengths)
            else:
                self.timer.summary.update(
                    prompt_lengths=prompt_lengths, completion_lengths=completion_lengths, phases=phases or {}
                )
            self.active = None
        elif step_index < self.recorded_steps:
            self.records.append(
                StepRecord(
                    step_index,
                    now - self.last_time,
                    cpu_now - self.last_cpu_time,
                    prompt_lengths,
                    completion_lengths,
                    reward,
                    phases or {},
                    faults_now - self.last_faults,
                    loss,
                )
            )
        self.last_time, self.last_cpu_time, self.last_faults = time.perf_counter(), time.process_time(), minor_page_faults()

    def result(self, spec: RunSpec) -> RunResult:
        import torch

        weights = dict(trainable_weights(self.model)) if self.model is not None else {}
        moved = None
        if self.initial_weights is not None:
            moved = max((weights[name].detach().float().cpu() - before).abs().max().item() for name, before in self.initial_weights.items())
        return RunResult(
            spec=dataclasses.asdict(spec),
            steps=self.records,
            setup_seconds=self.setup_seconds,
            rss_before_training_mib=self.rss_before_training,
            peak_rss_mib=peak_rss_mib(),
            torch_threads=torch.get_num_threads(),
            matmul_flops_by_dtype=dict(self.counter.counts) if self.counter is not None else None,
            counted_step_prompt_lengths=self.counted_lengths[0] if self.counted_lengths else None,
            counted_step_completion_lengths=self.counted_lengths[1] if self.counted_lengths else None,
            op_profile=self.timer.summary if self.timer is not None else None,
            peak_gpu_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if spec.device == "cuda" else None,
            trainable_dtypes=sorted({str(w.dtype).removeprefix("torch.") for w in weights.values()}) or None,
            max_weight_change=moved,
        )

    @classmethod
    def for_lightning(cls, recorded_steps: int, count_matmuls: bool, profile_ops: bool = False, record_weight_change: bool = False):
        import lightning.pytorch as pl

        class _LightningRecorder(cls, pl.Callback):
            def on_train_start(self, trainer, pl_module) -> None:
                self.train_start(pl_module.policy)

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                self.step_start()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                # the time/* metrics GRPOModule logged in this step ("n/a" in the tables when absent)
                metrics = trainer.callback_metrics
                phases = {k.removeprefix("time/"): float(v) for k, v in metrics.items() if k.startswith("time/")}
                self.step_end(phases, float(metrics["loss"]) if "loss" in metrics else None)

        return _LightningRecorder(recorded_steps, count_matmuls, profile_ops, record_weight_change)

    @classmethod
    def for_transformers(
        cls, recorded_steps: int, count_matmuls: bool, profile_ops: bool = False, optimizer_steps_per_record: int = 1,
        record_weight_change: bool = False,
    ):
        """A ``TrainerCallback`` whose records each cover ``optimizer_steps_per_record`` trainer steps
        (a record's loss is filled in from the trainer's log history after training)."""
        from transformers import TrainerCallback

        class _TransformersRecorder(cls, TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                self.train_start(model)

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step % optimizer_steps_per_record == 0:  # the first step of a generation batch
                    self.step_start()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step % optimizer_steps_per_record == 0:  # global_step counts this step already
                    self.step_end()

        return _TransformersRecorder(recorded_steps, count_matmuls, profile_ops, record_weight_change)


def trainable_weights(model):
    """``(name, tensor)`` of every weight of ``model`` that the optimizer updates."""
    return [(name, weight) for name, weight in model.named_parameters() if weight.requires_grad]


# ----------------------------------------------------------------------------------------------
# TRL
# ----------------------------------------------------------------------------------------------


class TRLPhaseTimer:
    """TRL 1.16 times named sections (``profiling_context``: ``transformers.generate``,
    ``_calculate_rewards``, ``_prepare_inputs``, ``compute_loss``,
    ``_get_per_token_logps_and_entropies``) but only reports them to wandb / mlflow / trackio.
    This patch records them instead, with the trainer step they belong to."""

    def __init__(self) -> None:
        from trl.extras import profiling

        self.spans: list[tuple[int, str, float, float]] = []  # (step, name, start, end)
        timer = self

        def record(context, duration: float) -> None:
            end = time.perf_counter()
            section = context.name.split(".", 1)[-1]  # "GRPOTrainer.compute_loss" -> "compute_loss"
            timer.spans.append((context.step, section, end - duration, end))

        profiling.ProfilingContext._log_metrics = record

    def phases(self, steps: range) -> dict[str, float]:
        """Seconds per phase of these optimizer steps (one generation batch), named like lit-grpo's
        ``time/*`` metrics.

        ``logprobs`` is the no-gradient log-prob forwards inside ``_prepare_inputs`` (the sampling
        policy's with ``num_iterations > 1``, the reference model's with beta > 0); the forwards
        inside ``compute_loss`` belong to ``train``, which is measured as the rest of the step after
        ``_prepare_inputs`` (forward, backward, clipping, optimizer)."""
        spans = [s for s in self.spans if s[0] in steps]
        total = defaultdict(float)
        for _, name, start, end in spans:
            total[name] += end - start
        loss_spans = [(s, e) for _, n, s, e in spans if n == "compute_loss"]
        logprobs = sum(
            end - start
            for _, name, start, end in spans
            if name == "_get_per_token_logps_and_entropies"
            and not any(ls <= start and end <= le for ls, le in loss_spans)
        )
        return {
            "generate": total["transformers.generate"],
            "rewards": total["_calculate_rewards"],
            "logprobs": logprobs,
            "prepare_inputs": total["_prepare_inputs"],
            "compute_loss": total["compute_loss"],
        }


def run_trl(spec: RunSpec) -> RunResult:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    phase_timer = TRLPhaseTimer()
    # TRL's optimizer steps alternate: the first of each num_iterations * steps_per_generation samples a
    # generation batch, the others train on it; a record covers them all, as one lit-grpo training_step does
    optimizer_steps = spec.num_iterations * spec.steps_per_generation  # per generation batch
    recorder = RecordingCallback.for_transformers(
        spec.steps, spec.count_matmuls, spec.profile_ops, optimizer_steps, spec.record_weight_change
    )
    dataset = datasets.load_dataset("json", data_files=spec.data_file, split="train")
    completions_per_step = spec.num_generations * spec.prompts_per_step
    generation_kwargs = {"min_new_tokens": spec.max_completion_length} if spec.fixed_length else None
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            use_cpu=spec.device == "cpu",
            bf16=spec.precision == "bf16",
            gradient_checkpointing=False,  # GRPOConfig defaults to True; lit-grpo's default is False
            per_device_train_batch_size=completions_per_step // spec.steps_per_generation,
            gradient_accumulation_steps=1,
            steps_per_generation=spec.steps_per_generation,
            num_generations=spec.num_generations,
            max_completion_length=spec.max_completion_length,
            generation_kwargs=generation_kwargs,
            temperature=spec.temperature,
            top_p=1.0,
            top_k=0,
            num_iterations=spec.num_iterations,
            loss_type="dapo",
            beta=spec.beta,
            epsilon=spec.epsilon,
            epsilon_high=spec.epsilon_high,
            scale_rewards="group",
            learning_rate=spec.learning_rate,
            lr_scheduler_type="constant",  # TrainingArguments defaults to linear decay
            weight_decay=0.0,
            optim="adamw_torch_fused",
            max_grad_norm=1.0,
            max_steps=(spec.steps + recorder.extra_steps) * optimizer_steps,
            seed=spec.seed,
            data_seed=spec.seed,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            log_completions=False,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=spec.model_dir,
            reward_funcs=[RECORDED_REWARDS[spec.reward]],
            args=config,
            train_dataset=dataset,
            callbacks=[recorder],
        )
        global TOKENIZER
        TOKENIZER = trainer.processing_class
        trainer.train()
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    for record in recorder.records:
        record.phases = phase_timer.phases(range(record.step * optimizer_steps, (record.step + 1) * optimizer_steps))
        record.loss = losses.get((record.step + 1) * optimizer_steps)  # the record's last optimizer step
    return recorder.result(spec)


def main(argv: list[str]) -> None:
    spec_path, result_path = argv
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    if spec.threads is not None:
        import torch

        torch.set_num_threads(spec.threads)
    runner = {"lit-grpo": run_lit_grpo, "trl": run_trl}[spec.trainer]
    result = runner(spec)
    Path(result_path).write_text(json.dumps(dataclasses.asdict(result), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
