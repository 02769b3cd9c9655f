"""The hooks a lit-grpo plugin may implement (pluggy project ``lit_grpo``).

A plugin module implements them with the ``lit_grpo.hookimpl`` marker and is found through the
``lit_grpo`` entry-point group (:mod:`lit_grpo.plugins`)::

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(my_reward)

    @lit_grpo.hookimpl
    def register_environments(register):
        register(MyEnvironment, name="my_environment")

    @lit_grpo.hookimpl
    def register_datasets(register):
        register(make_my_prompts, name="my_prompts")
"""

from __future__ import annotations

from collections.abc import Callable

from lit_grpo import hookspec

__all__ = ["RESERVED_ARGS", "Hookspecs"]

# The arguments the trainer passes to every reward call; a reward's YAML ``args`` must not bind them.
RESERVED_ARGS = ("prompts", "completions", "completion_ids")


class Hookspecs:
    """The hooks a lit-grpo plugin may implement."""

    @hookspec
    def register_rewards(self, register: Callable[..., None]) -> None:
        """Register reward functions or classes.

        Call ``register(obj, name=None)`` once per reward. ``obj`` is a function called as
        ``obj(prompts=..., completions=..., completion_ids=..., **columns)`` returning one
        ``float | None`` per completion, or a class whose constructor takes the reward's YAML
        ``args`` and whose instances are such callables. ``name`` (the name used in YAML)
        defaults to ``obj.__name__``.
        """

    @hookspec
    def register_environments(self, register: Callable[..., None]) -> None:
        """Register environment classes for multi-turn rollouts (:mod:`lit_grpo.rollout.tools.environments`).

        Call ``register(cls, name=None)`` once per environment. Each rollout gets its own instance,
        built from ``model.environment.args`` and the sample's columns its constructor names; its
        public methods are the tools the policy may call, and an optional ``get_reward()`` scores
        the rollout. ``name`` defaults to ``cls.__name__``.
        """

    @hookspec
    def register_datasets(self, register: Callable[..., None]) -> None:
        """Register prompt data sets that a plugin makes (generated, or read from another framework).

        Call ``register(function, name=None)`` once per data set. ``data.path: <name>`` loads it as
        ``function(split=..., **data.args)`` (``split``: ``data.split`` or ``data.val_split``), which
        returns a ``datasets.Dataset`` of prompts and the columns the rewards and environments read.
        ``name`` defaults to ``function.__name__``.
        """
