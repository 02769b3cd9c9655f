"""lit-grpo: GRPO for causal language models on PyTorch Lightning.

Plugin authors need only the two pluggy markers exported here::

    import lit_grpo

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(my_reward)
"""

import pluggy

__version__ = "0.1.0"

hookspec = pluggy.HookspecMarker("lit_grpo")
hookimpl = pluggy.HookimplMarker("lit_grpo")

__all__ = ["__version__", "hookimpl", "hookspec"]
