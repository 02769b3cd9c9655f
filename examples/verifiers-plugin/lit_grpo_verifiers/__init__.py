"""verifiers environments for lit-grpo: an installed environment (``vf.load_environment(name, **args)``)
trains in lit-grpo's own rollout.

* data set ``verifiers`` (``data.path: verifiers``, ``data.args: {environment, environment_args}``):
  the environment's dataset (split ``train``) or its eval dataset (split ``eval``), as verifiers
  formats them: ``prompt`` (chat messages, its system prompt first), ``answer``, ``info``, ``task``,
  ``example_id``;
* environment ``verifiers`` (``model.environment``, same ``args``): the environment's tools (a
  ``ToolEnv``'s ``tools``) become lit-grpo tools, called in lit-grpo's multi-turn rollout (the
  policy's token ids kept, the tool messages masked out of the loss);
* reward group ``verifiers_rubric`` (``model.rewards``, same ``args``): one lit-grpo reward per
  function of the environment's rubric (its rubric group flattened: the monitor rubrics verifiers
  adds too), logged under the function's name (``rewards/correct_answer/mean``) with the rubric's
  weight times the entry's. Each is called as verifiers' own ``Rubric`` calls it, on a verifiers
  ``State`` built from the row and the conversation after the prompt.

Which environments run: ``SingleTurnEnv`` and ``ToolEnv`` (and subclasses that only configure
them), whose rollout is "the model answers, calling the tools": lit-grpo's rollout does exactly
that. An environment that runs a rollout of its own (a ``MultiTurnEnv`` with its own
``env_response``, ``StatefulToolEnv``, sandbox and CLI-agent environments, an ``EnvGroup``), where
the environment drives the model through an OpenAI-compatible endpoint, is refused with one line
naming it: lit-grpo samples in-process and serves no such endpoint.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import importlib
import inspect
import json
from importlib import metadata
from typing import TYPE_CHECKING, Any

import lit_grpo
from lit_grpo.errors import ConfigError

if TYPE_CHECKING:
    import datasets as hf_datasets

# verifiers is imported where it is used: lit-grpo imports every plugin package to list what it
# registers, and importing verifiers takes seconds.

__all__ = ["VerifiersEnvironment", "load", "verifiers_dataset", "verifiers_rubric"]

SPLITS = ("train", "eval")
# what a verifiers environment overrides to run a rollout of its own, beyond "answer, calling the tools"
OWN_ROLLOUT = ("rollout", "env_response", "get_model_response", "setup_state", "is_completed", "update_tool_args")


def load(environment: str, environment_args: dict[str, Any] | None = None):
    """``vf.load_environment(environment, **environment_args)``, once per process for the same
    arguments; a name, arguments or a kind of environment lit-grpo cannot run is a one-line error."""
    return _load(environment, json.dumps(environment_args or {}, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _load(environment: str, args_json: str):
    import verifiers as vf
    from verifiers.utils.env_utils import env_module_name

    args = json.loads(args_json)
    module_name = env_module_name(environment)
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        installed = sorted(metadata.packages_distributions())
        close = difflib.get_close_matches(module_name, installed, n=1)
        hint = f"; did you mean {close[0].replace('_', '-')!r}?" if close else ""
        raise ConfigError(f"no verifiers environment {environment!r} is installed (no module {module_name!r}){hint}; "
                          f"install its package (pip install {environment})") from None
    load_environment = getattr(module, "load_environment", None)
    if not callable(load_environment):
        raise ConfigError(f"verifiers environment {environment!r}: module {module_name!r} has no load_environment()")
    try:
        inspect.signature(load_environment).bind(**args)
    except TypeError as error:
        parameters = list(inspect.signature(load_environment).parameters)
        close = [match for key in args for match in difflib.get_close_matches(key, parameters, n=1) if key not in parameters]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"environment_args of verifiers environment {environment!r}: {error}{hint} "
                          f"(its arguments: {', '.join(parameters)})") from None
    env = vf.load_environment(environment, **args)
    _check_runs_in_lit_grpo(environment, env)
    return env


def _check_runs_in_lit_grpo(environment: str, env) -> None:
    import verifiers as vf

    supported = next((cls for cls in (vf.ToolEnv, vf.SingleTurnEnv) if isinstance(env, cls)), None)
    base = supported or next(cls for cls in (vf.MultiTurnEnv, vf.Environment) if isinstance(env, cls))
    mro = type(env).__mro__
    own = [f"{cls.__name__}.{name}" for cls in mro[: mro.index(base)] for name in OWN_ROLLOUT if name in vars(cls)]
    if supported is None or own or isinstance(env, vf.StatefulToolEnv):
        why = f"overrides {', '.join(own)}" if own else f"is a {base.__name__}, not a SingleTurnEnv or ToolEnv"
        raise ConfigError(
            f"verifiers environment {environment!r} ({type(env).__name__}) {why}: it runs a rollout of its own, driving "
            "the model through an OpenAI-compatible endpoint, which lit-grpo does not serve; lit-grpo runs SingleTurnEnv "
            "and ToolEnv environments, in its own multi-turn rollout")


def verifiers_dataset(split: str, environment: str, environment_args: dict | None = None) -> hf_datasets.Dataset:
    """A verifiers environment's dataset (split train) or eval dataset (split eval), as verifiers formats it."""
    if split not in SPLITS:
        raise ConfigError(f"data set 'verifiers' has the splits {', '.join(SPLITS)}, not {split!r}")
    env = load(environment, environment_args)
    dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
    if "info" in dataset.column_names:  # arrow cannot hold rows whose info dicts differ: as verifiers reads it, JSON
        dataset = dataset.map(lambda row: {"info": json.dumps(row["info"])})
    return dataset


class VerifiersEnvironment:
    """The tools of a verifiers ToolEnv, for one rollout (a SingleTurnEnv has none)."""

    def __init__(self, environment: str, environment_args: dict | None = None):
        self.env = load(environment, environment_args)

    def tools(self) -> list:
        return list(getattr(self.env, "tools", None) or [])


@lit_grpo.reward_group
def verifiers_rubric(environment: str, environment_args: dict | None = None) -> list[tuple[Any, float]]:
    """One reward per function of a verifiers environment's rubric, with its weight."""
    env = load(environment, environment_args)
    rewards = []
    for rubric, function, weight in _rubric_functions(env.rubric):
        if rubric._is_group_func(function):
            raise ConfigError(f"verifiers environment {environment!r}: rubric function {function.__name__!r} scores a "
                              "group of rollouts together, which lit-grpo's rewards do not (they score each completion)")
        rewards.append((_rubric_reward(environment, rubric, function), weight))
    return rewards


def _rubric_functions(rubric) -> list[tuple[Any, Any, float]]:
    """``(rubric, function, weight)`` of every function of ``rubric``, a rubric group's flattened."""
    if hasattr(rubric, "rubrics"):
        return [item for member in rubric.rubrics for item in _rubric_functions(member)]
    return [(rubric, function, float(weight)) for function, weight in zip(rubric.funcs, rubric.weights)]


def _rubric_reward(environment: str, rubric, function):
    """A lit-grpo reward (a batch of completions) that scores each one with ``function`` as ``rubric`` does."""

    async def reward(prompts, completions, answer=None, info=None, task=None, example_id=None, **columns) -> list[float]:
        rows = range(len(completions))
        states = [_state(prompts[i], completions[i], answer[i] if answer else "", info[i] if info else None,
                         task[i] if task else None, example_id[i] if example_id else i) for i in rows]
        return list(await asyncio.gather(*(rubric._call_individual_reward_func(function, state) for state in states)))

    reward.__name__ = function.__name__
    reward.__qualname__ = f"{environment}.{function.__name__}"  # logged as rewards/<function name>/...
    reward.__doc__ = f"verifiers environment {environment!r}: rubric function {function.__name__}"
    return reward


def _state(prompt, completion, answer, info, task, example_id):
    """The verifiers ``State`` of a finished rollout, as its ``init_state`` and rollout would leave it."""
    from verifiers.types import State, flatten_task_input
    from verifiers.utils.message_utils import normalize_messages

    messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    row = {"prompt": prompt, "answer": answer, "example_id": example_id,
           "info": json.loads(info) if isinstance(info, str) else (info or {})}
    if task is not None:
        row["task"] = task
    state_task = flatten_task_input(row)
    state = State(input=state_task)
    state["task"] = state_task
    state["prompt"] = normalize_messages(prompt, field_name="prompt")
    state["completion"] = normalize_messages(messages, field_name="completion")
    state["trajectory"] = [{"prompt": prompt, "completion": [message], "reward": None, "advantage": None}
                           for message in state["completion"] if message.role == "assistant"]
    return state


@lit_grpo.hookimpl
def register_datasets(register):
    register(verifiers_dataset, name="verifiers")


@lit_grpo.hookimpl
def register_environments(register):
    register(VerifiersEnvironment, name="verifiers")


@lit_grpo.hookimpl
def register_rewards(register):
    register(verifiers_rubric)
