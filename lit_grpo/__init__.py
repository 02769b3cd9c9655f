"""lit-grpo: GRPO for causal language models on PyTorch Lightning.

From Python: ``from lit_grpo import GRPOModule, GRPODataModule`` (README: From Python). Plugin
authors need only the two pluggy markers exported here::

    import lit_grpo

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(my_reward)
"""

import pluggy

from lit_grpo import former_paths, openmp

# Before anything of lit-grpo imports torch: how its OpenMP threads wait (lit_grpo.openmp).
openmp.choose_wait_policy()
# ``lit_grpo.module`` and the other paths of the modules before they moved into packages
former_paths.install()

__version__ = "0.1.0"

hookspec = pluggy.HookspecMarker("lit_grpo")
hookimpl = pluggy.HookimplMarker("lit_grpo")

__all__ = ["GRPODataModule", "GRPOModule", "__version__", "hookimpl", "hookspec", "reward_group"]


def reward_group(function):
    """Mark a registered reward ``function`` as a group of rewards: a ``model.rewards`` entry naming it
    calls ``function(**args)``, which returns ``[(reward, weight), ...]``, and stands for those rewards,
    each scored and logged under its own name (``rewards/<its __name__>/mean``) with its weight times
    the entry's (another framework's rubric: one reward per scoring function)."""
    function.lit_grpo_reward_group = True
    return function


def __getattr__(name: str):
    """``from lit_grpo import GRPOModule, GRPODataModule``, imported on first use: a plugin's
    ``import lit_grpo`` (for the markers) stays cheap."""
    if name == "GRPOModule":
        from lit_grpo.train.module import GRPOModule

        return GRPOModule
    if name == "GRPODataModule":
        from lit_grpo.data import GRPODataModule

        return GRPODataModule
    raise AttributeError(f"module 'lit_grpo' has no attribute {name!r}")
