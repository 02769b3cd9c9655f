"""lit-grpo: GRPO for causal language models on PyTorch Lightning.

From Python: ``from lit_grpo import GRPOModule, GRPODataModule`` (README: From Python). Plugin
authors need only the two pluggy markers exported here::

    import lit_grpo

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(my_reward)
"""

import pluggy

from lit_grpo import openmp

# Before anything of lit-grpo imports torch: how its OpenMP threads wait (lit_grpo.openmp).
openmp.choose_wait_policy()

__version__ = "0.1.0"

hookspec = pluggy.HookspecMarker("lit_grpo")
hookimpl = pluggy.HookimplMarker("lit_grpo")

__all__ = ["GRPODataModule", "GRPOModule", "__version__", "hookimpl", "hookspec"]


def __getattr__(name: str):
    """``from lit_grpo import GRPOModule, GRPODataModule``, imported on first use: a plugin's
    ``import lit_grpo`` (for the markers) stays cheap."""
    if name == "GRPOModule":
        from lit_grpo.module import GRPOModule

        return GRPOModule
    if name == "GRPODataModule":
        from lit_grpo.data import GRPODataModule

        return GRPODataModule
    raise AttributeError(f"module 'lit_grpo' has no attribute {name!r}")
