"""The import paths of lit-grpo's modules before they moved into packages, kept working.

A run's saved ``config.yaml`` names its callbacks by class path (``lit_grpo.preemption.CheckpointOnSignal``),
a user's script may ``from lit_grpo.module import GRPOModule``, a vLLM server started by an older
``lit-grpo serve`` loads ``lit_grpo.engines.vllm_auth``: each former path imports the module at its new
path, the same module object, so classes, monkeypatches and pickles agree. Hand-written (a
``sys.meta_path`` finder of a few lines) because the standard library has no module alias.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

# former path -> where the module is now
MOVED = {
    "lit_grpo.agent": "lit_grpo.rollout.tools.tool_use",
    "lit_grpo.async_rollouts": "lit_grpo.rollout.async_pipeline",
    "lit_grpo.callbacks": "lit_grpo.run.callbacks",
    "lit_grpo.checkpointing": "lit_grpo.run.checkpointing",
    "lit_grpo.completions": "lit_grpo.run.completions",
    "lit_grpo.config_files": "lit_grpo.cli.config_files",
    "lit_grpo.dynamic_sampling": "lit_grpo.rollout.dynamic_sampling",
    "lit_grpo.engines": "lit_grpo.rollout.engines",
    "lit_grpo.engines.base": "lit_grpo.rollout.engines.base",
    "lit_grpo.engines.lit_sampler": "lit_grpo.rollout.engines.lit_sampler",
    "lit_grpo.engines.policy": "lit_grpo.rollout.engines.policy",
    "lit_grpo.engines.policy_weights": "lit_grpo.rollout.engines.policy_weights",
    "lit_grpo.engines.requests": "lit_grpo.rollout.engines.requests",
    "lit_grpo.engines.server_lost": "lit_grpo.rollout.engines.server_lost",
    "lit_grpo.engines.vllm_auth": "lit_grpo.rollout.engines.vllm_auth",
    "lit_grpo.engines.vllm_colocated": "lit_grpo.rollout.engines.vllm_colocated",
    "lit_grpo.engines.vllm_gloo": "lit_grpo.rollout.engines.vllm_gloo",
    "lit_grpo.engines.vllm_plugin": "lit_grpo.rollout.engines.vllm_plugin",
    "lit_grpo.engines.vllm_sampling": "lit_grpo.rollout.engines.vllm_sampling",
    "lit_grpo.engines.vllm_serve": "lit_grpo.rollout.engines.vllm_serve",
    "lit_grpo.engines.vllm_server": "lit_grpo.rollout.engines.vllm_server",
    "lit_grpo.environments": "lit_grpo.rollout.tools.environments",
    "lit_grpo.evaluation": "lit_grpo.algorithm.evaluation",
    "lit_grpo.export": "lit_grpo.run.export",
    "lit_grpo.generation": "lit_grpo.rollout.engines.requests",
    "lit_grpo.lightning_cli": "lit_grpo.cli.lightning_cli",
    "lit_grpo.logprobs": "lit_grpo.train.logprob_passes",
    "lit_grpo.module": "lit_grpo.train.module",
    "lit_grpo.multi_turn": "lit_grpo.rollout.tools.multi_turn",
    "lit_grpo.named_functions": "lit_grpo.plugins.named_functions",
    "lit_grpo.policy_weights": "lit_grpo.rollout.engines.policy_weights",
    "lit_grpo.preemption": "lit_grpo.run.preemption",
    "lit_grpo.python_objects": "lit_grpo.plugins.python_objects",
    "lit_grpo.reference": "lit_grpo.train.reference",
    "lit_grpo.runs": "lit_grpo.run.directory",
    "lit_grpo.sampling_correction": "lit_grpo.algorithm.sampling_correction",
    "lit_grpo.sampling_filters": "lit_grpo.algorithm.sampling_filters",
    "lit_grpo.shared_prompt": "lit_grpo.train.shared_prompt",
    "lit_grpo.tools": "lit_grpo.rollout.tools.calls",
    "lit_grpo.trl_names": "lit_grpo.cli.trl_names",
}


class FormerPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a former path and loads the module from where it is now (first on ``sys.meta_path``, so
    that ``lit_grpo.engines.vllm_auth`` is not found a second time, as a copy, inside the moved package)."""

    def __init__(self) -> None:
        self.specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "lit_grpo.engines")

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        """Already executed at its new path: only its own ``__spec__`` back (the import system set the
        former path's)."""
        module.__spec__ = self.specs.pop(module.__spec__.name)


def install() -> None:
    if not any(isinstance(finder, FormerPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, FormerPaths())
