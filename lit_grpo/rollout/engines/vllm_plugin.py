"""lit-grpo's vLLM plugin: the ``gloo`` weight-transfer engines in vLLM's factories.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (the API server, the
engine core, every worker): lit-grpo's (``pyproject.toml``) calls :func:`register`, so that a server
started with ``--weight-transfer-config '{"backend": "gloo"}'`` (what ``lit-grpo serve`` does on the
CPU) takes weights from the trainer over gloo (:mod:`lit_grpo.rollout.engines.vllm_gloo`). Registered by module
path: nothing of lit-grpo is imported until a gloo engine is made.
"""

from __future__ import annotations

__all__ = ["GLOO", "register"]

GLOO = "gloo"


def register() -> None:
    """Register the gloo engines with vLLM's worker- and trainer-side factories (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    engines = ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
               (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine"))
    for factory, class_name in engines:
        try:
            factory.register_engine(GLOO, "lit_grpo.rollout.engines.vllm_gloo", class_name)
        except ValueError:  # registered already: vLLM may load a plugin more than once
            pass
