"""The generation engines: what samples the completions a run trains on (``model.generation_backend``).

Every engine implements :class:`~lit_grpo.rollout.engines.base.GenerationEngine` (sync the policy's weights
when they changed, generate from prompt ids, close), so the module and multi-turn rollouts use any of
them the same way:

==================  ==========================================  ====================================
backend             engine                                      weights
==================  ==========================================  ====================================
``lit``             :mod:`~lit_grpo.rollout.engines.policy` with the    the policy itself
                    group sampler of :mod:`~.lit_sampler`
``transformers``    :mod:`~lit_grpo.rollout.engines.policy` with        the policy itself
                    ``generate``
``vllm``            :mod:`~lit_grpo.rollout.engines.vllm_colocated`,    pushed in-process
                    one ``vllm.LLM`` in each training process
``vllm_server``     :mod:`~lit_grpo.rollout.engines.vllm_server`,       pushed through vLLM's weight-transfer
                    vLLM servers on other GPUs or nodes         API (:mod:`~.vllm_gloo` on the CPU)
==================  ==========================================  ====================================

The vLLM engines share their sampling requests (:mod:`~lit_grpo.rollout.engines.vllm_sampling`);
``lit-grpo serve`` starts a server the ``vllm_server`` backend can use (:mod:`~.vllm_serve`).
"""

from __future__ import annotations

from typing import Any

from lit_grpo.errors import ConfigError

__all__ = ["GENERATION_BACKENDS", "check_backend", "engine_for_run"]

GENERATION_BACKENDS = ("lit", "transformers", "vllm", "vllm_server")


def check_backend(hp) -> None:
    """Fail now, before any model is loaded, on a backend whose extra is missing or whose settings
    cannot work."""
    if hp.generation_backend in ("vllm", "vllm_server"):
        from lit_grpo.rollout.engines.vllm_colocated import require_vllm

        require_vllm()
    if hp.generation_backend == "vllm_server":
        from lit_grpo.rollout.engines.vllm_server import VLLMServerEngine

        VLLMServerEngine.check_settings(hp)
    elif hp.vllm_server_urls:
        raise ConfigError(f"model.vllm_server_urls is set but model.generation_backend is {hp.generation_backend!r}: "
                          "set model.generation_backend: vllm_server to sample on those servers")


def engine_for_run(hp, model_source: Any, precision: str, grows_with_tools: bool):
    """The engine ``hp.generation_backend`` names, not started yet (``model_source``: where the
    policy comes from; ``grows_with_tools``: tool results lengthen rollouts past prompt + completion)."""
    if hp.generation_backend == "vllm":
        from lit_grpo.rollout.engines.vllm_colocated import ColocatedVLLMEngine

        return ColocatedVLLMEngine.for_run(hp, model_source, precision, grows_with_tools)
    if hp.generation_backend == "vllm_server":
        from lit_grpo.rollout.engines.vllm_server import VLLMServerEngine

        return VLLMServerEngine.for_run(hp, grows_with_tools)
    from lit_grpo.rollout.engines.policy import PolicyEngine

    return PolicyEngine(hp.generation_backend)
