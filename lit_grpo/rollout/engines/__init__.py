"""The generation engines: what samples the completions a run trains on (``model.generation_backend``).

Every engine implements :class:`~lit_grpo.rollout.engines.base.GenerationEngine` (sync the policy's weights
when they changed, generate from prompt ids, close), so the module and multi-turn rollouts use any of
them the same way:

================  =======================================================  ================================
backend           engine                                                   weights
================  =======================================================  ================================
``lit``           :mod:`~.policy` with the group sampler of                the policy itself
                  :mod:`~.lit_sampler`
``transformers``  :mod:`~.policy` with ``generate``                        the policy itself
``vllm``          :mod:`~.vllm_colocated`, one ``vllm.LLM`` in each        pushed in-process
                  training process
``vllm_server``   :mod:`~.vllm_server`, vLLM servers on other GPUs or      pushed through vLLM's weight-
                  nodes                                                    transfer API (:mod:`~.vllm_gloo`
                                                                           on the CPU)
================  =======================================================  ================================

:data:`ENGINES` is the registry: each backend's name and its engine's class (an :class:`EngineClass`).
The vLLM engines share their sampling requests (:mod:`~lit_grpo.rollout.engines.vllm_sampling`);
``lit-grpo serve`` starts a server the ``vllm_server`` backend can use (:mod:`~.vllm_serve`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, Protocol

from lit_grpo.errors import ConfigError

if TYPE_CHECKING:
    from lit_grpo.rollout.engines.base import GenerationEngine

__all__ = ["ENGINES", "GENERATION_BACKENDS", "EngineClass", "check_backend", "engine_class", "engine_for_run"]


class EngineClass(Protocol):
    """What the registry asks of an engine's class: to check a run's settings before any model is
    loaded (a missing extra, settings that cannot work), and to build the run's engine, not started."""

    @classmethod
    def check_run(cls, hp) -> None: ...

    @classmethod
    def for_run(cls, hp, model_source: Any, precision: str, grows_with_tools: bool) -> GenerationEngine: ...


# ``model.generation_backend`` -> its engine's class, as ``"module:Class"``: a module is imported only
# when a run picks it (the vLLM engines need the vllm extra). A new engine: its module, and one line here.
ENGINES: dict[str, str] = {
    "lit": "lit_grpo.rollout.engines.policy:PolicyEngine",
    "transformers": "lit_grpo.rollout.engines.policy:PolicyEngine",
    "vllm": "lit_grpo.rollout.engines.vllm_colocated:ColocatedVLLMEngine",
    "vllm_server": "lit_grpo.rollout.engines.vllm_server:VLLMServerEngine",
}

GENERATION_BACKENDS = tuple(ENGINES)  # the names model.generation_backend may take


def engine_class(backend: str) -> EngineClass:
    """The class of the engine ``backend`` names (its module imported now)."""
    if backend not in ENGINES:
        raise ConfigError(f"model.generation_backend must be one of {GENERATION_BACKENDS}, got {backend!r}")
    module, name = ENGINES[backend].split(":")
    return getattr(import_module(module), name)


def check_backend(hp) -> None:
    """Fail now, before any model is loaded, on a backend whose extra is missing or whose settings
    cannot work."""
    engine = engine_class(hp.generation_backend)
    engine.check_run(hp)
    if hp.vllm_server_urls and not engine.samples_elsewhere:  # servers given to an engine that samples here
        raise ConfigError(f"model.vllm_server_urls is set but model.generation_backend is {hp.generation_backend!r}: "
                          "set model.generation_backend: vllm_server to sample on those servers")


def engine_for_run(hp, model_source: Any, precision: str, grows_with_tools: bool) -> GenerationEngine:
    """The engine ``hp.generation_backend`` names, not started yet (``model_source``: where the
    policy comes from; ``grows_with_tools``: tool results lengthen rollouts past prompt + completion)."""
    return engine_class(hp.generation_backend).for_run(hp, model_source, precision, grows_with_tools)
