"""Tool use in training: what ``model.tools`` and ``model.environment`` switch on.

:class:`ToolUse` is the module's side of :mod:`lit_grpo.multi_turn`: it loads the tools and the
environments once (a bad name fails before any model is loaded), starts one conversation per
completion row (the prompt rendered with the tools' schemas), runs the rollouts through the
module's sampler, and turns the conversations into a :class:`~lit_grpo.rollout.Rollout`, the
environments' reward columns and the ``tools/*`` and ``turns/*`` metrics.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lit_grpo import plugins
from lit_grpo.environments import Environments
from lit_grpo.errors import ConfigError
from lit_grpo.generation import tokenize_prompts
from lit_grpo.multi_turn import Conversation, TurnOutput, conversation_statistics, render, run_conversations, to_rollout
from lit_grpo.rollout import Rollout, is_conversational
from lit_grpo.tools import Tool, make_tool, parse_hermes

__all__ = ["ToolUse"]

# model.tool_call_parser names that need no import
TOOL_CALL_PARSERS = {"hermes": parse_hermes}


class ToolUse:
    """``model.tools``, ``model.environment``, ``max_tool_calling_iterations``, ``tool_timeout``,
    ``tool_call_parser``."""

    def __init__(self, tools: Sequence[str] | None, environment: Any, max_tool_calling_iterations: int | None,
                 tool_timeout: float | None, tool_call_parser: str | None) -> None:
        self.tools: list[Tool] = []
        for index, spec in enumerate(tools or []):
            where = f"model.tools[{index}] {spec!r}"
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
        if tool_call_parser is None or tool_call_parser in TOOL_CALL_PARSERS:
            self.parser: Callable | None = TOOL_CALL_PARSERS.get(tool_call_parser)
        else:
            self.parser = plugins.load_object(tool_call_parser, "model.tool_call_parser", ConfigError)[0]

    @classmethod
    def from_settings(cls, hp: Mapping) -> ToolUse | None:
        """The tool use the hyperparameters ask for, or None (single-turn rollouts)."""
        if not hp.get("tools") and not hp.get("environment"):
            return None
        return cls(hp.get("tools"), hp.get("environment"), hp.get("max_tool_calling_iterations"),
                   hp.get("tool_timeout"), hp.get("tool_call_parser"))

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
        conversations = []
        for index, prompt in enumerate(prompts):
            messages = prompt if is_conversational(prompt) else [{"role": "user", "content": prompt}]
            row_columns = {name: values[index] for name, values in columns.items()}
            rendered: dict[tuple[str, ...], tuple[list[int], bool]] = {}  # the G rows share their tools
            for _ in range(num_generations):
                name, instance, tools = self.environments.build(row_columns, index)
                if tuple(tools) not in rendered:
                    schemas = [tool.schema for tool in tools.values()]
                    text = render(tokenizer, messages, schemas, True, dict(chat_template_kwargs or {}))
                    ids, mask, cut = tokenize_prompts(tokenizer, [text], max_prompt_length, torch.device("cpu"))
                    rendered[tuple(tools)] = ids[0][mask[0].bool()].tolist(), bool(cut[0])
                prompt_ids, truncated = rendered[tuple(tools)]
                conversations.append(Conversation(
                    prompt=messages, prompt_ids=list(prompt_ids), prompt_truncated=truncated,
                    tools=tools, environment=name, environment_instance=instance,
                ))
        return conversations

    def rollout(self, conversations: list[Conversation], generate_ids: Callable, tokenizer, config,
                max_completion_length: int, chat_template_kwargs: Mapping[str, Any] | None,
                any_rank_active: Callable[[bool], bool] | None, device: torch.device) -> Rollout:
        """Run the conversations with ``generate_ids(prompt_ids, prompt_mask, config) -> Rollout | None``
        (the module's sampler, one completion per row) and return them as a rollout."""
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
                outputs.append(TurnOutput(tokens, logps, bool(tokens) and tokens[-1] in eos))
            return outputs

        run_conversations(
            conversations, generate_turn, tokenizer, max_completion_length, self.max_tool_calling_iterations,
            self.tool_timeout, self.parser, dict(chat_template_kwargs or {}), any_rank_active,
        )
        rollout = to_rollout(conversations, tokenizer.pad_token_id, device, with_sampling_logps=any(engine_logps))
        rollout.conversations = list(conversations)
        return rollout

    def environment_rewards(self, conversations: Sequence[Conversation]) -> torch.Tensor:
        """``[N, E]`` the environments' ``get_reward()`` (NaN: None, or another environment's row)."""
        columns = self.environments.reward_columns(
            [c.environment for c in conversations], [c.environment_instance for c in conversations]
        )
        values = [[float("nan") if value is None else value for value in column] for column in columns.values()]
        return torch.tensor(values, dtype=torch.float32).T.reshape(len(conversations), len(columns))

    @staticmethod
    def metrics(conversations: Sequence[Conversation], reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tools/calls_per_rollout``, ``tools/failure_frac`` and ``turns/mean`` over every rank."""
        totals = {name: reduce_sum(value) for name, value in conversation_statistics(conversations).items()}
        rollouts = totals["rollouts"].clamp(min=1.0)
        return {
            "tools/calls_per_rollout": totals["tool_calls"] / rollouts,
            "tools/failure_frac": totals["tool_failures"] / totals["tool_calls"].clamp(min=1.0),
            "turns/mean": totals["turns"] / rollouts,
        }

