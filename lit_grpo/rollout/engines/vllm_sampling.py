"""vLLM's sampling as lit-grpo asks for it: what the colocated engine and the server client share.

Both vLLM engines sample with the same semantics, so that a run gives the same completions on either
(:mod:`lit_grpo.rollout.engines.vllm_colocated`, :mod:`lit_grpo.rollout.engines.vllm_server`):

* :func:`sampling_settings`: a run's ``GenerationConfig`` as vLLM's sampling parameters (greedy
  without ``do_sample``; every EOS id a stop id, and the only stop condition besides the length);
* :func:`sampling_requests`: one request per prompt with ``n=G``, its seed ``seed + i*G`` (vLLM seeds
  completion g with ``seed + i*G + g``); greedy with G > 1 as G requests (vLLM refuses ``n > 1``
  greedily); each request asks for the log-prob of every sampled token;
* :class:`EngineOutput`: what comes back, prompt-major, with the sampler's log-probs (the engine runs
  with ``logprobs_mode="processed_logprobs"``: after penalties, temperature and min-p/top-k/top-p,
  renormalised over the kept tokens, as the trainer recomputes them, :mod:`lit_grpo.algorithm.sampling_filters`)
  and the weight version each completion was sampled with;
* :func:`engine_rollout`: that output as a :class:`~lit_grpo.rollout.records.Rollout`;
* :func:`draw_engine_seed`: the seed of one call, drawn from the rank's checkpointed torch generator
  and made distinct per rank (:func:`engine_seed`);
* :func:`vllm_generation_kwargs`: ``model.generation_kwargs`` and ``model.vllm_structured_outputs_regex``
  as further ``SamplingParams`` arguments of every request (TRL's), checked at start
  (:func:`check_vllm_generation_kwargs`: their values as vLLM builds them, and a warning naming those the
  trainer's log-probs ignore).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from lit_grpo.config import backend_generation_kwargs, optional_setting, warn_unrecomputed_arguments
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines.requests import check_arguments_build, check_generation_kwargs
from lit_grpo.rollout.records import Rollout

__all__ = ["EngineOutput", "check_sampling_params_values", "check_vllm_generation_kwargs", "completion_tensors",
           "draw_engine_seed", "engine_rollout", "engine_seed", "process_rank", "sampling_requests", "sampling_settings",
           "vllm_generation_kwargs"]


def engine_seed(drawn: int, rank: int) -> int:
    """The engine's seed for one call: ``drawn`` from the rank's (checkpointed) torch generator, made
    distinct per rank (Lightning seeds every rank alike, so equal prompts on two ranks would
    otherwise sample equal completions)."""
    return (drawn * 1_000_003 + rank) % (2**31 - 1)


def process_rank() -> int:
    """This process's rank in the run (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def draw_engine_seed() -> int:
    """One seed for one generation call: a draw from this rank's torch generator (saved in every
    checkpoint, so a resumed run draws the same), mixed with the rank."""
    return engine_seed(int(torch.randint(0, 2**31 - 1, (1,)).item()), process_rank())


def sampling_settings(config: GenerationConfig) -> dict:
    """The sampling settings of ``config`` as :func:`sampling_requests` takes them."""
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return dict(
        temperature=config.temperature if config.do_sample else 0.0,
        top_p=config.top_p if config.do_sample and config.top_p is not None else 1.0,
        top_k=config.top_k if config.do_sample and config.top_k else 0,
        min_p=config.min_p if config.do_sample and config.min_p else 0.0,
        repetition_penalty=config.repetition_penalty or 1.0,
        max_tokens=config.max_new_tokens,
        stop_token_ids=eos,
    )


def vllm_generation_kwargs(hp) -> dict:
    """The further ``SamplingParams`` arguments of every request of a run with settings ``hp`` (the vllm extra
    installed): ``model.generation_kwargs`` less its sampling-distribution arguments (the named keys' values,
    :func:`lit_grpo.config.named_settings_given_elsewhere`), with ``structured_outputs`` (a mapping, as the
    server's JSON takes it) ``{"regex": model.vllm_structured_outputs_regex}`` where that is set (TRL: it
    takes precedence, with TRL's warning); one line naming an argument vLLM does not take."""
    arguments = backend_generation_kwargs(hp)
    regex = optional_setting(hp, "vllm_structured_outputs_regex")
    if not arguments and regex is None:
        return {}  # nothing to check or add: vLLM itself not needed here
    from vllm import SamplingParams

    fields = {name for name in SamplingParams.__struct_fields__ if not name.startswith("_")}  # msgspec's field names
    check_generation_kwargs(arguments, fields.__contains__, hp.generation_backend, "vLLM's SamplingParams fields")
    if regex is not None:
        try:
            re.compile(regex)
        except (re.error, TypeError) as error:
            raise ConfigError(f"model.vllm_structured_outputs_regex is not a regular expression: {error} (got {regex!r})") from None
        if arguments.get("structured_outputs") is not None:
            warnings.warn("Both `structured_outputs_regex` and `generation_kwargs['structured_outputs']` are set; "
                          "`structured_outputs_regex` takes precedence.", stacklevel=2)  # TRL 1.16's
        arguments["structured_outputs"] = {"regex": regex}
    structured = arguments.get("structured_outputs")
    if structured is not None and not isinstance(structured, dict):
        raise ConfigError(f"model.generation_kwargs.structured_outputs must be a mapping (e.g. {{regex: ...}}), got {structured!r}")
    check_sampling_params_values(arguments, hp.max_completion_length)
    return arguments


def check_sampling_params_values(arguments: dict, max_tokens: int) -> None:
    """One line naming what vLLM refuses in ``arguments`` (``SamplingParams`` fields), at start instead of at the
    first request: the parameters built as every request builds them (token ids out, ``detokenize=False``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def build(values: dict) -> None:
        structured = values.get("structured_outputs")
        SamplingParams(**{**values, "structured_outputs": None if structured is None else StructuredOutputsParams(**structured)},
                       detokenize=False, max_tokens=max_tokens)

    check_arguments_build(build, arguments, (Exception,))  # vLLM's VLLMValidationError is no ValueError


def check_vllm_generation_kwargs(hp) -> None:
    """At start: :func:`vllm_generation_kwargs` checked, and one warning naming those that change the distribution
    vLLM samples from but not the trainer's (:func:`lit_grpo.config.warn_unrecomputed_arguments`)."""
    vllm_generation_kwargs(hp)
    warn_unrecomputed_arguments(hp, engine_logprobs_corrected=True)  # the engine's processed log-probs follow them


def sampling_requests(
    prompt_token_ids: Sequence[Sequence[int]],
    num_generations: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    max_tokens: int = 16,
    stop_token_ids: Sequence[int] = (),
    seed: int | Sequence[int] | None = None,
    return_logprobs: bool = True,
    extra_arguments: Mapping[str, Any] | None = None,
) -> list[tuple[list[int], dict]]:
    """``(prompt token ids, vLLM SamplingParams arguments)`` of every request that samples
    ``num_generations`` completions per prompt, in prompt order; their completions, in order, are
    the rows of the rollout.

    ``seed``: an int is the base seed of the call (prompt i gets ``seed + i*G``), a sequence one per
    prompt (its completions get ``seed_i + g``), None none (vLLM's global generator then samples).
    ``temperature`` 0 is greedy. ``extra_arguments``: further ``SamplingParams`` arguments of every request
    (:func:`vllm_generation_kwargs`).
    """
    G = num_generations
    params = dict(
        n=G,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k and top_k > 0 else 0,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        max_tokens=max_tokens,
        stop_token_ids=sorted(set(int(token) for token in stop_token_ids)),
        logprobs=0 if return_logprobs else None,
        flat_logprobs=True,
        detokenize=False,
        skip_special_tokens=False,
    )
    params.update(extra_arguments or {})
    if seed is None or isinstance(seed, int):
        seeds = [None if seed is None else seed + index * G for index in range(len(prompt_token_ids))]
    else:
        seeds = [int(value) for value in seed]
        if len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts")
    prompts = [list(map(int, ids)) for ids in prompt_token_ids]
    greedy = temperature < 1e-5  # vLLM's own threshold; it refuses n > 1 with greedy decoding
    if greedy and G > 1:
        params["n"] = 1
        prompts = [prompt for prompt in prompts for _ in range(G)]
        seeds = [value for value in seeds for _ in range(G)]
    return [(prompt, {**params, "seed": value}) for prompt, value in zip(prompts, seeds)]


@dataclass
class EngineOutput:
    """G completions per prompt, prompt-major: rows ``i*G .. i*G+G-1`` belong to prompt i."""

    completion_ids: list[list[int]] = field(default_factory=list)  # [N][C_i] sampled tokens, EOS included when it stopped
    logprobs: list[list[float]] = field(default_factory=list)  # [N][C_i] sampler log-probs of those tokens (processed)
    finish_reasons: list[str] = field(default_factory=list)  # [N] "stop" (an EOS / stop id) or "length" (max_tokens)
    stop_token_ids: list[int | None] = field(default_factory=list)  # [N] the id it stopped at
    weight_versions: list[str | None] = field(default_factory=list)  # [N] the engine's weight version label (servers)

    @property
    def is_truncated(self) -> list[bool]:
        return [reason == "length" for reason in self.finish_reasons]

    def add(self, token_ids: list[int], logprobs: list[float], finish_reason: str, weight_version: str | None = None) -> None:
        """One completion, after the ones before it."""
        self.completion_ids.append(token_ids)
        self.logprobs.append(logprobs)
        self.finish_reasons.append(finish_reason)
        self.stop_token_ids.append(token_ids[-1] if finish_reason == "stop" and token_ids else None)
        self.weight_versions.append(weight_version)


def completion_tensors(output: EngineOutput, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``output`` as right-padded ``completion_ids``, ``completion_mask``, ``sampling_logps`` ``[N, C]``
    and ``is_truncated`` ``[N]``, from the engine's own lengths and finish reasons: never by looking for
    EOS ids in the padded tensor, where a pad id that is also an EOS id (Qwen's ``<|endoftext|>``)
    would end a row that stopped at its length limit with a token it never sampled."""
    width = max(1, max((len(ids) for ids in output.completion_ids), default=0))
    completion_ids = torch.full((len(output.completion_ids), width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros(completion_ids.shape, dtype=torch.long)
    sampling_logps = torch.zeros(completion_ids.shape, dtype=torch.float32)
    for row, (ids, logps) in enumerate(zip(output.completion_ids, output.logprobs)):
        completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        completion_mask[row, : len(ids)] = 1
        sampling_logps[row, : len(logps)] = torch.tensor(logps, dtype=torch.float32)
    is_truncated = torch.tensor([reason != "stop" for reason in output.finish_reasons], dtype=torch.bool)
    return completion_ids, completion_mask, sampling_logps, is_truncated


def engine_rollout(output: EngineOutput, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompt_truncated: torch.Tensor,
                   num_generations: int, pad_token_id: int, weight_versions: int | list[int]) -> Rollout:
    """The rollout of ``output`` for the left-padded prompts ``[B, P]`` it answered, on their device;
    ``weight_versions``: the policy version that sampled each row (one int: all of them)."""
    completion_ids, completion_mask, sampling_logps, is_truncated = (
        tensor.to(prompt_ids.device) for tensor in completion_tensors(output, pad_token_id)
    )
    repeat = lambda tensor: tensor.repeat_interleave(num_generations, dim=0)  # noqa: E731
    rollout = Rollout(
        repeat(prompt_ids), repeat(prompt_mask), completion_ids, completion_mask, is_truncated, repeat(prompt_truncated),
        sampling_logps=sampling_logps,
        weight_versions=torch.as_tensor(
            weight_versions if isinstance(weight_versions, list) else [weight_versions] * len(completion_ids),
            dtype=torch.long, device=prompt_ids.device),
    )
    return rollout.trimmed()
