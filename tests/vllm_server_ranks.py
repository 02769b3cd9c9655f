"""The ranks of a 2-process run (gloo, CPU) of the vLLM server engine, for tests/rollout/test_vllm_server.py.

``python vllm_server_ranks.py MODEL_DIR CALL=URL_OF_RANK_0,URL_OF_RANK_1 ...`` with torch.distributed's
variables set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). For each call, in order,
each rank makes an engine on its own server (a stand-in, tests/vllm_server_fake.py) and:

- ``sample``: samples two prompts (``engine.generate``) with the weights of a first push;
- ``fsdp2_push``: pushes MODEL_DIR's model, sharded with FSDP2 over both ranks (``engine.sync_weights``).

After each, it checks that both ranks are still in step (a barrier, which a rank left in another
collective never reaches) and prints one line, ``CALL raised CLASS: MESSAGE`` or ``CALL returned``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GenerationConfig


def call(mode: str, url: str, model_dir: str) -> None:
    from lit_grpo.rollout.engines.vllm_server import VLLMServerEngine

    engine = VLLMServerEngine([url], timeout=3)
    engine.start()
    try:
        if mode == "sample":
            engine.pushed_version = 0  # as after a first push (the stand-in labels nothing)
            prompt_ids = torch.tensor([[5, 6, 7], [0, 8, 9]])  # [B, P], left-padded
            config = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=3, eos_token_id=2)
            engine.generate(prompt_ids, prompt_ids != 0, torch.zeros(2, dtype=torch.bool), 2, config, 0)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            policy = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
            mesh = init_device_mesh("cpu", (2,))
            for layer in policy.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(policy, mesh=mesh)
            engine.sync_weights(policy, version=1)
    finally:
        engine.close()


def main(model_dir: str, calls: list[str]) -> None:
    dist.init_process_group("gloo")
    for word in calls:
        mode, urls = word.split("=")
        try:
            call(mode, urls.split(",")[dist.get_rank()], model_dir)
            said = "returned"
        except Exception as error:  # noqa: BLE001 - what the rank would end the run with
            said = f"raised {type(error).__name__}: {error}"
        dist.barrier()
        print(f"{mode} {said}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
