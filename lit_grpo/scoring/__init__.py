"""Scoring completions with the configured reward functions.

- :class:`RewardScorer` (:mod:`lit_grpo.scoring.scorer`): the ``model.rewards`` list as one callable
  returning the ``[N, K]`` reward matrix, in-process, in worker pools or on an event loop;
  :func:`check_data_columns`: the columns the rewards take are in the data, before the run;
- :class:`RewardSpec` (:mod:`lit_grpo.scoring.specs`): one entry of that list;
- :func:`build_reward` (:mod:`lit_grpo.scoring.arguments`): a registered reward with its YAML ``args``
  bound (the registry itself: :mod:`lit_grpo.plugins`);
- :mod:`lit_grpo.scoring.pool`: the worker processes of ``num_workers > 0`` rewards;
- :mod:`lit_grpo.scoring.failures`: what a reward's failure on a sample says.
"""

from lit_grpo.scoring.arguments import build_reward
from lit_grpo.scoring.scorer import RewardScorer, check_data_columns
from lit_grpo.scoring.specs import ON_ERROR, RewardError, RewardSpec

__all__ = ["ON_ERROR", "RewardError", "RewardScorer", "RewardSpec", "build_reward", "check_data_columns"]
