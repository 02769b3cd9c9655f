"""Scoring completions with the configured reward functions.

- :class:`RewardScorer` (:mod:`lit_grpo.scoring.scorer`): the ``model.rewards`` list as one callable
  returning the ``[N, K]`` reward matrix, in-process, in worker pools or on an event loop;
  :func:`check_data_columns`: the columns the rewards take are in the data, before the run;
- :class:`RewardSpec` (:mod:`lit_grpo.scoring.specs`): one entry of that list;
- :func:`build_reward` (:mod:`lit_grpo.scoring.arguments`): a registered reward with its YAML ``args``
  bound (the registry itself: :mod:`lit_grpo.plugins`);
- :mod:`lit_grpo.scoring.pool`: the worker processes of ``num_workers > 0`` rewards;
- :mod:`lit_grpo.scoring.failures`: what a reward's failure on a sample says.

The names above are imported on first use, so that a worker process, which imports
:mod:`lit_grpo.scoring.pool` (standard library only), starts without importing torch.
"""

import importlib

__all__ = ["ON_ERROR", "RewardError", "RewardScorer", "RewardSpec", "build_reward", "check_data_columns"]

_WHERE = {
    "build_reward": "lit_grpo.scoring.arguments",
    "RewardScorer": "lit_grpo.scoring.scorer",
    "check_data_columns": "lit_grpo.scoring.scorer",
    "ON_ERROR": "lit_grpo.scoring.specs",
    "RewardError": "lit_grpo.scoring.specs",
    "RewardSpec": "lit_grpo.scoring.specs",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lit_grpo.scoring' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
