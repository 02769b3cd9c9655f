"""Tool use in training: what ``model.tools`` and ``model.environment`` switch on.

:class:`ToolUse` is the module's side of :mod:`lit_grpo.rollout.tools.multi_turn`: it loads the tools and the
environments once (a bad name fails before any model is loaded), starts one conversation per
completion row (the prompt rendered with the tools' schemas), runs the rollouts through the
module's sampler, and turns the conversations into a :class:`~lit_grpo.rollout.records.Rollout`, the
environments' reward columns and the ``tools/*`` and ``turns/*`` metrics. Each rollout's
environment lives from :meth:`ToolUse.start` to the end of :meth:`ToolUse.rollout`: its reward is
read when the rollout ends, then it is closed, also when something failed on the way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import torch

from lit_grpo import plugins
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines.requests import tokenize_prompts
from lit_grpo.rollout.records import Rollout, is_conversational
from lit_grpo.rollout.tools.calls import TOOL_CALL_PARSERS, Tool, make_tool
from lit_grpo.rollout.tools.environments import Environments
from lit_grpo.rollout.tools.multi_turn import (
    Conversation,
    TurnOutput,
    conversation_statistics,
    render,
    run_conversations,
    to_rollout,
)
from lit_grpo.settings import ToolSettings

__all__ = ["ToolUse"]


class ToolUse:
    """``model.tools``, ``model.environment``, ``max_tool_calling_iterations``, ``tool_timeout``,
    ``tool_call_parser``, ``max_tool_result_length``."""

    def __init__(self, tools: Sequence[str] | None, environment: Any, max_tool_calling_iterations: int | None,
                 tool_timeout: float | None, tool_call_parser: str | None, max_tool_result_length: int | None = None) -> None:
        self.tools: list[Tool] = []
        for index, spec in enumerate(tools or []):
            where = f"model.tools[{index}] {spec!r}"
            if callable(spec) and not isinstance(spec, str):  # a function given in Python
                self.tools.append(make_tool(spec, where))
                continue
            if not isinstance(spec, str) or ":" not in spec:
                raise ConfigError(f"{where}: a tool is named 'package.module:function' or 'path/to/file.py:function'")
            function, _ = plugins.load_object(spec, f"model.tools[{index}]", ConfigError)
            self.tools.append(make_tool(function, where))
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"model.tools has two tools of the same name: {names}")
        self.environments = Environments(environment, plugins.get_environment, self.tools)
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.tool_timeout = tool_timeout
        self.max_tool_result_length = max_tool_result_length
        if tool_call_parser is None or tool_call_parser in TOOL_CALL_PARSERS:
            self.parser: Callable | None = TOOL_CALL_PARSERS.get(tool_call_parser)
        else:
            self.parser = plugins.load_object(tool_call_parser, "model.tool_call_parser", ConfigError)[0]

    @classmethod
    def from_settings(cls, settings: ToolSettings | Mapping) -> ToolUse | None:
        """The tool use ``settings`` ask for, or None (single-turn rollouts); a mapping (the ``model:``
        block as the CLI reads it) is made a :class:`~lit_grpo.settings.ToolSettings` first, its missing
        keys at their defaults."""
        if isinstance(settings, Mapping):
            settings = ToolSettings(**{field.name: settings[field.name] for field in fields(ToolSettings) if field.name in settings})
        if not settings.enabled:
            return None
        return cls(settings.tools, settings.environment, settings.max_tool_calling_iterations, settings.tool_timeout,
                   settings.tool_call_parser, settings.max_tool_result_length)

    @property
    def reward_names(self) -> list[str]:
        return self.environments.reward_names

    @property
    def reward_weights(self) -> list[float]:
        return self.environments.reward_weights

    def start(self, prompts: Sequence, columns: Mapping[str, Sequence], num_generations: int, tokenizer,
              max_prompt_length: int | None, chat_template_kwargs: Mapping[str, Any] | None) -> list[Conversation]:
        """``num_generations`` conversations per prompt (prompt-major), each with its own environment."""
        if tokenizer.chat_template is None:
            raise ConfigError(
                f"model.tools / model.environment need a chat template to show the tools to the model, and the tokenizer "
                f"of {getattr(tokenizer, 'name_or_path', '?')!r} has none (set model.chat_template or use a chat model)"
            )
        conversations: list[Conversation] = []
        try:
            for index, prompt in enumerate(prompts):
                messages = prompt if is_conversational(prompt) else [{"role": "user", "content": prompt}]
                row_columns = {name: values[index] for name, values in columns.items()}
                rendered: dict[tuple[str, ...], tuple[list[int], bool]] = {}  # the G rows share their tools
                for _ in range(num_generations):
                    name, instance, tools = self.environments.build(row_columns, index)
                    conversations.append(Conversation(prompt=messages, prompt_ids=[], prompt_truncated=False, tools=tools,
                                                      environment=name, environment_instance=instance))
                    if tuple(tools) not in rendered:
                        schemas = [tool.schema for tool in tools.values()]
                        text = render(tokenizer, messages, schemas, True, dict(chat_template_kwargs or {}))
                        ids, mask, cut = tokenize_prompts(tokenizer, [text], max_prompt_length, torch.device("cpu"))
                        rendered[tuple(tools)] = ids[0][mask[0].bool()].tolist(), bool(cut[0])
                    prompt_ids, truncated = rendered[tuple(tools)]
                    conversations[-1].prompt_ids, conversations[-1].prompt_truncated = list(prompt_ids), truncated
        except BaseException:
            self.close(conversations)  # the environments built before the failure
            raise
        return conversations

    def render_prompt(self, prompt, columns: Mapping[str, Any], tokenizer, chat_template_kwargs: Mapping[str, Any] | None) -> str:
        """The text of one prompt as the policy sees it with the tools of its row (its environment's
        built from ``columns``, one sample's values, then closed): ``lit-grpo prompts``."""
        (conversation,) = self.start([prompt], {name: [value] for name, value in columns.items()}, 1, tokenizer, None,
                                     chat_template_kwargs)
        self.close([conversation])
        messages = prompt if is_conversational(prompt) else [{"role": "user", "content": prompt}]
        return render(tokenizer, messages, conversation.schemas, True, dict(chat_template_kwargs or {}))

    def rollout(self, conversations: list[Conversation], generate_ids: Callable, tokenizer, config,
                max_completion_length: int, chat_template_kwargs: Mapping[str, Any] | None,
                any_rank_active: Callable[[bool], bool] | None, device: torch.device,
                max_sequence_length: int | None = None) -> Rollout:
        """Run the conversations with ``generate_ids(prompt_ids, prompt_mask, config) -> Rollout | None``
        (the module's engine, one completion per row: any of :mod:`lit_grpo.rollout.engines`) and return them
        as a rollout, each row with the oldest weights that sampled one of its turns; then read the
        environments' rewards and close them (closed also when anything failed).
        ``max_sequence_length``: the longest prompt + completion the sampler takes (the model's or the
        engine's context), which tool results may not overflow."""
        try:
            rollout = self._run(conversations, generate_ids, tokenizer, config, max_completion_length,
                                chat_template_kwargs, any_rank_active, device, max_sequence_length)
            self.read_environment_rewards(conversations)
        finally:
            self.close(conversations)
        return rollout

    def close(self, conversations: Sequence[Conversation]) -> None:
        """Close every conversation's environment (``close()``, where it has one), once."""
        for conversation in conversations:
            instance, conversation.environment_instance = conversation.environment_instance, None
            if instance is not None:
                self.environments.close(conversation.environment, instance)

    def _run(self, conversations: list[Conversation], generate_ids: Callable, tokenizer, config,
             max_completion_length: int, chat_template_kwargs: Mapping[str, Any] | None,
             any_rank_active: Callable[[bool], bool] | None, device: torch.device,
             max_sequence_length: int | None) -> Rollout:
        eos = config.eos_token_id
        eos = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
        engine_logps = []  # whether the sampler returned its own log-probs (vLLM)

        def generate_turn(contexts: list[list[int]], max_new_tokens: int) -> list[TurnOutput]:
            width = max((len(context) for context in contexts), default=0)
            ids = torch.full((len(contexts), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(contexts), width), dtype=torch.long)
            for row, context in enumerate(contexts):
                ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
                mask[row, width - len(context) :] = 1
            turn_config = copy.deepcopy(config)
            turn_config.max_new_tokens = max(1, max_new_tokens)
            rollout = generate_ids(ids.to(device), mask.to(device), turn_config)
            if rollout is None:  # nothing to generate on this rank (it still joined the collective)
                return []
            engine_logps.append(rollout.sampling_logps is not None)
            outputs = []
            for row in range(len(contexts)):
                row_mask = rollout.completion_mask[row].bool()
                tokens = rollout.completion_ids[row][row_mask].tolist()
                logps = rollout.sampling_logps[row][row_mask].tolist() if rollout.sampling_logps is not None else None
                version = int(rollout.weight_versions[row]) if rollout.weight_versions is not None else None
                outputs.append(TurnOutput(tokens, logps, bool(tokens) and not bool(rollout.is_truncated[row]), version))
            return outputs

        run_conversations(
            conversations, generate_turn, tokenizer, max_completion_length, self.max_tool_calling_iterations,
            self.tool_timeout, self.parser, dict(chat_template_kwargs or {}), any_rank_active,
            max_tool_result_length=self.max_tool_result_length, max_sequence_length=max_sequence_length,
            stop_token_ids=sorted(eos) or None,
        )
        rollout = to_rollout(conversations, tokenizer.pad_token_id, device, with_sampling_logps=any(engine_logps))
        rollout.conversations = list(conversations)
        return rollout

    def read_environment_rewards(self, conversations: Sequence[Conversation]) -> None:
        """Read each ended rollout's environment reward into its conversation (``environment_reward``)."""
        for row, conversation in enumerate(conversations):
            if conversation.environment is not None and conversation.environment_instance is not None:
                conversation.environment_reward = self.environments.reward(
                    conversation.environment, conversation.environment_instance, row)

    def environment_rewards(self, conversations: Sequence[Conversation]) -> torch.Tensor:
        """``[N, E]`` the environments' ``get_reward()`` (NaN: None, or another environment's row)."""
        names = self.reward_names
        values = torch.full((len(conversations), len(names)), float("nan"))
        for row, conversation in enumerate(conversations):
            if conversation.environment in names and conversation.environment_reward is not None:
                values[row, names.index(conversation.environment)] = conversation.environment_reward
        return values

    @staticmethod
    def metrics(conversations: Sequence[Conversation], reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tools/calls_per_rollout``, ``tools/failure_frac``, ``tools/truncated_frac``,
        ``tools/dropped_frac`` and ``turns/mean`` over every rank."""
        totals = {name: reduce_sum(value) for name, value in conversation_statistics(conversations).items()}
        rollouts = totals["rollouts"].clamp(min=1.0)
        calls = totals["tool_calls"].clamp(min=1.0)
        return {
            "tools/calls_per_rollout": totals["tool_calls"] / rollouts,
            "tools/failure_frac": totals["tool_failures"] / calls,
            "tools/truncated_frac": totals["tool_results_truncated"] / calls,  # cut to max_tool_result_length
            "tools/dropped_frac": totals["tool_results_dropped"] / calls,  # would have overflowed the context
            "turns/mean": totals["turns"] / rollouts,
        }

