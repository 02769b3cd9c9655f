"""lit-grpo: GRPO for causal language models on PyTorch Lightning.

Plugin authors need only the two pluggy markers exported here::

    import lit_grpo

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(my_reward)
"""

import os

import pluggy

# oneDNN (PyTorch's CPU kernels for bf16 matmuls) keeps a compiled primitive for each of the last
# 1024 distinct shapes by default; GRPO's shapes change at every decode step and micro-batch chunk,
# so under bf16 that cache alone grew a 4M-parameter run's peak memory by about 385 MiB. 128 entries
# hold one step's training shapes: on a CPU with AMX, whose kernels are costly to compile, 16 (the
# earlier cap) made steps 9-13 % slower (README, Performance). Read by oneDNN at its first bf16
# matmul; a value the user has set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")

__version__ = "0.1.0"

hookspec = pluggy.HookspecMarker("lit_grpo")
hookimpl = pluggy.HookimplMarker("lit_grpo")

__all__ = ["__version__", "hookimpl", "hookspec"]
