"""OpenEnv environments for lit-grpo: the environment of an OpenEnv server (``openenv-core``), reset for
every rollout, its steps taken as tool calls, its reward the rollout's.

* environment ``openenv`` (``model.environment: {name: openenv, args: {base_url: http://127.0.0.1:8000}}``):
  each rollout opens its own session with openenv's ``GenericEnvClient`` (any OpenEnv server, without
  the environment's own package) and resets it (``reset_args``, and the row's ``seed`` column when it
  has one, so a row is the same episode every time). Its one tool, ``step`` (``tool_name``), takes the
  fields of the server's action (its JSON schema, from the server's ``/schema``) as arguments, sends
  the action and returns the observation; after the step that ends the episode, further calls fail
  and say so. ``get_reward()`` is the sum of the steps' rewards (``reward: last``: the last one), 0.0
  without a step. The session is closed when the rollout ends;
* data set ``openenv`` (``data.path: openenv``, ``data.args: {base_url, size, seed}``): the prompts are
  the observations of ``reset(seed=seed + i)`` (split ``train``; ``validation``: from ``seed + 1000000``),
  written as JSON (``prompt_field``: one field of them, as it is), with their ``seed`` column, so each
  rollout starts from the state its prompt shows.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
from typing import TYPE_CHECKING

import lit_grpo
from lit_grpo.errors import ConfigError

if TYPE_CHECKING:
    import datasets as hf_datasets

__all__ = ["OpenEnvEnvironment", "action_schema", "openenv_dataset"]

JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}
NOT_OBSERVED = ("done", "reward", "metadata")  # reported apart from what the environment shows
VAL_SEED_OFFSET = 1_000_000


@functools.lru_cache(maxsize=16)
def action_schema(base_url: str) -> dict:
    """The JSON schema of the actions the OpenEnv server at ``base_url`` takes (its ``/schema``)."""
    import httpx

    try:
        response = httpx.get(base_url.rstrip("/") + "/schema", timeout=10.0)
        response.raise_for_status()
        return response.json()["action"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        raise ConfigError(f"no OpenEnv server answers at base_url {base_url!r} ({type(error).__name__}: {error}); "
                          "start it first, e.g. python -m uvicorn <env>.server.app:app --port 8000") from None


def _client(base_url: str):
    from openenv.core import GenericEnvClient

    action_schema(base_url)  # a server that is not there is a one-line error, not a traceback
    return GenericEnvClient(base_url=base_url).sync().connect()


def _observed(result) -> dict:
    return {key: value for key, value in dict(result.observation or {}).items() if key not in NOT_OBSERVED}


class OpenEnvEnvironment:
    """An OpenEnv server's environment, reset for each rollout; its steps are the tool, its reward the rollout's."""

    def __init__(self, base_url: str, seed: int | None = None, reset_args: dict | None = None, tool_name: str = "step",
                 reward: str = "sum"):
        if reward not in ("sum", "last"):
            raise ConfigError(f"model.environment.args.reward of 'openenv' is sum or last, not {reward!r}")
        self.base_url, self.tool_name, self.reward = base_url, tool_name, reward
        self.schema = action_schema(base_url)
        self.client = _client(base_url)
        self.lock = threading.Lock()  # the calls of one turn run in threads of their own; one session takes one at a time
        reset = dict(reset_args or {})
        if seed is not None:
            reset["seed"] = int(seed)
        first = self.client.reset(**reset)
        self.observation, self.done, self.rewards = _observed(first), bool(first.done), []

    def tools(self) -> list:
        """One tool: a step, whose arguments are the fields of the server's action."""
        properties = {name: field for name, field in self.schema.get("properties", {}).items() if name != "metadata"}
        required = set(self.schema.get("required", []))
        parameters, lines = [], []
        for name in sorted(properties, key=lambda name: name not in required):  # required ones first
            field = properties[name]
            default = inspect.Parameter.empty if name in required else field.get("default")
            parameters.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                                annotation=JSON_TYPES.get(field.get("type"), str)))
            lines.append(f"        {name}: {field.get('description') or field.get('title') or name}")

        def step(**action):
            return self._take_step(action)

        step.__name__ = step.__qualname__ = self.tool_name
        step.__signature__ = inspect.Signature(parameters, return_annotation=str)
        step.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters} | {"return": str}
        summary = self.schema.get("description") or f"Take a step in the environment (action {self.schema.get('title', '')})."
        step.__doc__ = f"{summary.strip()}\n\n    Args:\n" + "\n".join(lines)
        return [step]

    def _take_step(self, action: dict) -> str:
        """Send ``action``; the observation as JSON (with ``"done": true`` once the episode is over)."""
        with self.lock:
            if self.done:
                raise RuntimeError("the episode is over: no more steps")
            result = self.client.step(action)
            self.done = bool(result.done)
            self.rewards.append(result.reward)
            self.observation = _observed(result)
        return json.dumps({**self.observation, **({"done": True} if self.done else {})})

    def get_reward(self) -> float:
        """The sum of the steps' rewards (reward: last, the last one); 0.0 without a step."""
        rewards = [float(value) for value in self.rewards if value is not None]
        if not rewards:
            return 0.0
        return rewards[-1] if self.reward == "last" else sum(rewards)

    def close(self) -> None:
        self.client.close()


def openenv_dataset(split: str, base_url: str, size: int = 64, seed: int = 0, val_size: int = 16,
                    prompt_field: str | None = None, reset_args: dict | None = None) -> hf_datasets.Dataset:
    """The observations of an OpenEnv server's resets (one per seed) as prompts, with their seed column."""
    import datasets as hf_datasets

    if split not in ("train", "validation"):
        raise ConfigError(f"data set 'openenv' has the splits train and validation, not {split!r}")
    first, count = (seed, size) if split == "train" else (seed + VAL_SEED_OFFSET, val_size)
    client = _client(base_url)
    rows = []
    try:
        for episode_seed in range(first, first + count):
            observation = _observed(client.reset(**(reset_args or {}), seed=episode_seed))
            if prompt_field is not None and prompt_field not in observation:
                raise ConfigError(f"data.args.prompt_field: the observations of {base_url} have no field {prompt_field!r}; "
                                  f"they have {', '.join(observation)}")
            prompt = str(observation[prompt_field]) if prompt_field is not None else json.dumps(observation)
            rows.append({"prompt": prompt, "seed": episode_seed})
    finally:
        client.close()
    return hf_datasets.Dataset.from_list(rows)


@lit_grpo.hookimpl
def register_environments(register):
    register(OpenEnvEnvironment, name="openenv")


@lit_grpo.hookimpl
def register_datasets(register):
    register(openenv_dataset, name="openenv")
