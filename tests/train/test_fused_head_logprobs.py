"""Every log-prob pass through the fused LM head (issue 53.1): the same log-probs, entropy and gradients
as the model's own logits, for the policy with and without shared prompts, with the sampling filters,
with a LoRA adapter on the head and for the KL reference; the head's scaling and soft-capping as each
listed architecture's forward applies them; and no forward makes the logits of more than a tile of tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import logps_entropy_grads
from test_shared_prompt import REWARDS, hand_made_rollout
from transformers import AutoConfig, AutoModelForCausalLM

import lit_grpo.algorithm.fused_lm_head
import lit_grpo.models
import lit_grpo.train.logprob_passes
from lit_grpo.algorithm.fused_lm_head import fused_token_logprobs, sampling_transform
from lit_grpo.algorithm.sampling_filters import SamplingFilters
from lit_grpo.models import decoder_hidden_states, output_head
from lit_grpo.train.module import GRPOModule

FILTERS = {
    "temperature": dict(temperature=0.7),
    "top-k, top-p, min-p and the penalty": dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
}


def close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def with_full_logits(monkeypatch):
    """The passes as before the fused head: every model's head 'unknown', so its logits are asked for."""
    monkeypatch.setattr(lit_grpo.models, "output_head", lambda model: "a head not known to be linear")


def logits_tokens(model) -> list[int]:
    """The number of tokens (rows x positions) with logits in every forward of ``model``."""
    tokens = []
    model.register_forward_hook(lambda module, args, output: tokens.append(output.logits.shape[:2].numel()))
    return tokens


TILE_TOKENS = 3


@pytest.fixture
def module(tiny_model_dir, monkeypatch):
    """The tiny policy, whose passes score tiles of 3 tokens (the fused head runs where a forward has more)."""
    torch.manual_seed(0)
    module = GRPOModule(str(tiny_model_dir), rewards=REWARDS, num_generations=4, max_completion_length=9)
    module.configure_model()
    vocab_size = module.policy.config.vocab_size
    monkeypatch.setattr(lit_grpo.algorithm.fused_lm_head, "LOGITS_TILE_BYTES", TILE_TOKENS * 4 * vocab_size)
    return module


@pytest.mark.parametrize("share_prompt_forward", [False, True])
@pytest.mark.parametrize("filters", list(FILTERS))
def test_policy_passes_equal_the_full_logits(module, monkeypatch, filters, share_prompt_forward):
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)  # share even this small batch
    rollout = hand_made_rollout(module.tokenizer, [9, 3, 5, 1, 2, 9, 6, 4, 3, 2, 7, 1], order=[0, 1, 2] * 4)
    settings = dict(share_prompt_forward=share_prompt_forward, forward_token_budget=40, **FILTERS[filters])
    tokens = logits_tokens(module.policy)
    fused = logps_entropy_grads(module, rollout, **settings)
    assert tokens and max(tokens) <= TILE_TOKENS  # no forward made the logits of more than a tile
    with monkeypatch.context() as patch:
        with_full_logits(patch)
        full = logps_entropy_grads(module, rollout, **settings)
    assert max(tokens) > 4 * TILE_TOKENS
    mask = rollout.completion_mask.bool()
    close(fused[0][mask], full[0][mask])
    close(fused[1][mask], full[1][mask])
    close(fused[2], full[2], atol=1e-5)  # every weight's gradient, summed over all tokens


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # the tiny model ties its head: peft says so
def test_lora_on_the_head_and_the_reference_without_its_adapter(tiny_model_dir, monkeypatch):
    """An adapter on the output head (and q_proj): its gradients, and the KL reference's log-probs
    (the policy with its adapter disabled), equal those from the full logits."""
    torch.manual_seed(1)
    lora = {"target_modules": ["q_proj", "lm_head"], "r": 4, "init_lora_weights": False}
    module = GRPOModule(str(tiny_model_dir), rewards=REWARDS, num_generations=4, max_completion_length=9, lora=lora)
    module.configure_model()
    monkeypatch.setattr(lit_grpo.algorithm.fused_lm_head, "LOGITS_TILE_BYTES", TILE_TOKENS * 4 * module.policy.config.vocab_size)
    assert type(output_head(module.policy).head).__module__.startswith("peft")  # the LoRA-wrapped head
    rollout = hand_made_rollout(module.tokenizer, [4, 6, 2, 5], order=[0, 1, 2, 0])
    fused = logps_entropy_grads(module, rollout, **FILTERS["top-k, top-p, min-p and the penalty"])
    fused_reference = module.logprobs.reference_logps(module.policy, None, rollout)
    with monkeypatch.context() as patch:
        with_full_logits(patch)
        full = logps_entropy_grads(module, rollout)
        full_reference = module.logprobs.reference_logps(module.policy, None, rollout)
    mask = rollout.completion_mask.bool()
    close(fused[0][mask], full[0][mask])
    close(fused[2], full[2], atol=1e-5)  # the adapter's gradients (the base weights are frozen)
    close(fused_reference[mask], full_reference[mask])
    assert not torch.allclose(fused_reference[mask], fused[0][mask])  # the adapter was really off


ARCHITECTURES = {  # model_type: what its configuration adds to a small decoder (MoE and MLA sizes kept small)
    "qwen3": {"tie_word_embeddings": True},
    "gemma": {"head_dim": 8},
    "ministral": {"head_dim": 8},
    "gemma2": {"final_logit_softcapping": 0.5, "head_dim": 8},
    "gemma3_text": {"final_logit_softcapping": 0.5, "head_dim": 8},
    "granite": {"logits_scaling": 0.3},
    "cohere": {"logit_scale": 3.0},
    "cohere2": {"logit_scale": 0.0625},
    "mixtral": {"num_local_experts": 4},
    "granitemoe": {"num_local_experts": 4},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "deepseek_v3": {"q_lora_rank": None, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
}


@pytest.mark.parametrize("model_type", sorted(lit_grpo.models.FUSED_HEAD_MODEL_TYPES))
def test_the_head_of_each_listed_architecture_gives_its_logits(model_type):
    """decoder + head + the configuration's scaling or soft-capping reproduce the model's own logits,
    and the fused log-probs are the log-softmax of them."""
    torch.manual_seed(2)
    shape = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=None)  # some default padding ids lie outside 101 tokens
    config = AutoConfig.for_model(model_type, **shape, **ARCHITECTURES.get(model_type, {}))
    model = AutoModelForCausalLM.from_config(config).eval()
    input_ids = torch.randint(0, 101, (2, 12))
    parts = output_head(model)
    assert not isinstance(parts, str), parts
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits  # [2, 12, V]
        hidden = decoder_hidden_states(model, parts, input_ids=input_ids)  # [2, 12, H]
        logps, _ = fused_token_logprobs(
            hidden[:, :-1], parts.fused(), input_ids[:, 1:], parts.vocab_size,
            sampling_transform(SamplingFilters(), input_ids[:, 1:], parts.vocab_size,
                               logit_scale=parts.logit_scale, softcapping=parts.softcapping))
    close(logps, logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1))


def test_an_unlisted_architecture_keeps_its_logits_and_says_so_once(module, monkeypatch):
    monkeypatch.setattr(lit_grpo.models, "FUSED_HEAD_MODEL_TYPES", frozenset())
    messages = []
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "rank_zero_info", messages.append)
    rollout = hand_made_rollout(module.tokenizer, [3, 2, 5, 4], order=[0, 1, 2, 0])
    tokens = logits_tokens(module.policy)
    for _ in range(2):
        module.logprobs.completion_logps(module.policy, rollout)
    assert min(tokens) > TILE_TOKENS
    model_type = module.policy.config.model_type
    assert messages == [
        f"log-probs from the model's full logits, not the fused LM head: {type(module.policy).__name__} "
        f"(model_type {model_type!r}) is not one whose head is known to be a linear layer"
    ]


@pytest.mark.parametrize("share_prompt_forward", [False, True])
def test_training_steps_are_the_same_with_the_fused_head(tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch,
                                                         share_prompt_forward):
    """Whole GRPO steps (beta > 0, two iterations, micro-batches going backward in length chunks, with
    and without shared prompts, whose hidden states collect the chunks' gradients) log the same loss,
    KL and entropy and reach the same weights as with the model's full logits."""
    import lightning.pytorch as pl

    from lit_grpo.data import GRPODataModule

    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)

    def train():
        pl.seed_everything(0, verbose=False)
        module = GRPOModule(
            str(tiny_model_dir), rewards=REWARDS, num_generations=4, max_completion_length=12, beta=0.1,
            num_iterations=2, micro_batch_size=6, share_prompt_forward=share_prompt_forward, forward_token_budget=24,
            log_completions_every_n_steps=0, optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        )
        module.configure_model()
        monkeypatch.setattr(lit_grpo.algorithm.fused_lm_head, "LOGITS_TILE_BYTES", TILE_TOKENS * 4 * module.policy.config.vocab_size)
        module.generation_config.sequence_bias = {(module.tokenizer.eos_token_id,): 2.0}  # lengths vary
        logged = {}
        module.log = lambda name, value, **kwargs: logged.setdefault(name, []).append(float(value))
        data = GRPODataModule(path="json", data_files=str(say_a_or_b_file), batch_size=3, seed=0)
        fast_trainer(max_steps=3).fit(module, datamodule=data)
        return logged, torch.cat([p.detach().flatten() for p in module.policy.parameters()])

    hidden_state_prefixes = []
    encode_prompts = lit_grpo.train.logprob_passes.encode_prompts

    def recording_encode_prompts(*args):
        prefix = encode_prompts(*args)
        hidden_state_prefixes.append(prefix.last_hidden is not None)
        return prefix

    monkeypatch.setattr(lit_grpo.train.logprob_passes, "encode_prompts", recording_encode_prompts)
    fused_passes = []
    fused_token_logprobs = lit_grpo.algorithm.fused_lm_head.fused_token_logprobs

    def counting_fused_token_logprobs(*args, **kwargs):
        fused_passes.append(torch.is_grad_enabled())
        return fused_token_logprobs(*args, **kwargs)

    monkeypatch.setattr(lit_grpo.algorithm.fused_lm_head, "fused_token_logprobs", counting_fused_token_logprobs)
    fused, fused_weights = train()
    assert all(hidden_state_prefixes) and bool(hidden_state_prefixes) == share_prompt_forward
    assert True in fused_passes and False in fused_passes  # the trained forward and the no-gradient passes
    with monkeypatch.context() as patch:
        with_full_logits(patch)
        full, weights = train()
    for name in ("loss", "kl", "entropy", "reward", "completions/mean_length"):
        torch.testing.assert_close(torch.tensor(fused[name]), torch.tensor(full[name]), atol=1e-5, rtol=1e-4)
    assert (weights != 0).any()
    torch.testing.assert_close(fused_weights, weights, atol=1e-5, rtol=1e-4)


def test_cast_lm_head_to_fp32_scores_every_pass_with_a_float32_head(tiny_model_dir, monkeypatch):
    """``model.cast_lm_head_to_fp32``: every pass goes through the fused head, also a forward whose
    logits fit in one tile (without the option the model's own logits), and the head's product is in
    float32: with bf16 weights the log-probs are those of the hidden states and weight upcast, not
    bf16's. A LoRA adapter on the head is refused in one line (as TRL refuses it)."""
    torch.manual_seed(3)
    module = GRPOModule(str(tiny_model_dir), rewards=REWARDS, num_generations=4, max_completion_length=9,
                        temperature=0.7, cast_lm_head_to_fp32=True)
    module.configure_model()
    module.policy.to(torch.bfloat16)
    rollout = hand_made_rollout(module.tokenizer, [4, 6, 2, 5], order=[0, 1, 2, 0])
    heads, hiddens = [], []
    fused_token_logprobs = lit_grpo.algorithm.fused_lm_head.fused_token_logprobs

    def recording(hidden, head, *args, **kwargs):
        heads.append(head)
        hiddens.append(hidden)
        return fused_token_logprobs(hidden, head, *args, **kwargs)

    monkeypatch.setattr(lit_grpo.algorithm.fused_lm_head, "fused_token_logprobs", recording)
    logps, _ = module.logprobs.completion_logps(module.policy, rollout, group_by_length=False)
    assert len(heads) == 1 and heads[0].float32 and heads[0].weight.dtype == torch.bfloat16
    width = logps.size(1)
    weight = output_head(module.policy).head.weight
    logits = torch.nn.functional.linear(hiddens[0].float(), weight.float()) / 0.7  # [n, C, V]
    expected = logits.log_softmax(-1).gather(-1, rollout.completion_ids[:, :width, None]).squeeze(-1)
    mask = rollout.completion_mask[:, :width].bool()
    close(logps[mask], expected[mask])
    heads.clear()
    from conftest import set_hparams

    set_hparams(module, cast_lm_head_to_fp32=False)
    bf16_logps, _ = module.logprobs.completion_logps(module.policy, rollout, group_by_length=False)
    assert not heads  # one tile's logits: the model's own forward, in bf16
    assert (bf16_logps[mask] - logps[mask]).abs().max() > 1e-4  # bf16 rounding of small logits (the tiny model's)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_cast_lm_head_to_fp32_with_a_lora_adapter_on_the_head_is_refused(tiny_model_dir):
    from lit_grpo.errors import ConfigError

    lora = {"target_modules": ["q_proj", "lm_head"], "r": 4}
    module = GRPOModule(str(tiny_model_dir), rewards=REWARDS, num_generations=4, max_completion_length=9, lora=lora,
                        cast_lm_head_to_fp32=True)
    module.configure_model()
    rollout = hand_made_rollout(module.tokenizer, [4, 6, 2, 5], order=[0, 1, 2, 0])
    with pytest.raises(ConfigError, match=r"^model.cast_lm_head_to_fp32 needs the fused LM head on a torch.nn.Linear of "
                                          r"plain tensors; the head is a LoRA adapter on lm_head "
                                          r"\(peft.tuners.lora.layer.Linear\)$"):
        module.logprobs.completion_logps(module.policy, rollout)


def test_cast_lm_head_to_fp32_on_a_linear_head_of_another_kind_of_weight_is_refused_not_dropped():
    """An ``nn.Linear`` whose weight is not a plain tensor (a quantised weight, torchao's) runs through
    the module itself: with ``cast_lm_head_to_fp32`` that is a ConfigError naming the weight's class,
    not a head silently left in its own dtype."""
    from lit_grpo.errors import ConfigError
    from lit_grpo.models import OutputHead

    class QuantisedWeight(torch.nn.Parameter):
        pass

    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = QuantisedWeight(head.weight.detach())
    parts = OutputHead(torch.nn.Identity(), head, 10)
    assert parts.fused() is head  # without the cast: the checkpointed tiles of the module
    with pytest.raises(ConfigError, match=r"^model.cast_lm_head_to_fp32 needs the fused LM head on a torch.nn.Linear of "
                                          r"plain tensors; the head is a torch.nn.modules.linear.Linear whose weight is a "
                                          r".*QuantisedWeight$"):
        parts.fused(float32=True)


def fsdp2_worker(rank: int, init_file: str, model_dir: str, results: str) -> None:
    """One of two FSDP2 ranks: log-probs and the full gradients of the sharded policy, from the fused
    head in tiles of 3 tokens and from the model's logits, each rank on its own rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_grpo.distributed import gathered_for_generation, shard_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    module = GRPOModule(model_dir, rewards=REWARDS, num_generations=4, max_completion_length=9)
    module.configure_model()
    shard_model(module.policy, init_device_mesh("cpu", (2,)))
    lit_grpo.algorithm.fused_lm_head.LOGITS_TILE_BYTES = TILE_TOKENS * 4 * module.policy.config.vocab_size
    rollout = hand_made_rollout(module.tokenizer, [9, 3, 5, 1, 2, 9][rank::2] * 2, order=[0, 1, 2, rank, 2, 1])

    def logps_and_gradients():
        module.policy.zero_grad()
        logps, _ = module.logprobs.completion_logps(module.policy, rollout, with_entropy=True)
        (logps * rollout.completion_mask[:, : logps.size(1)]).sum().backward()
        return logps.detach(), [p.grad.full_tensor() for p in module.policy.parameters()]

    with gathered_for_generation(module.policy):  # as sampling does before the first training forward
        pass
    tokens = logits_tokens(module.policy)
    fused = logps_and_gradients()
    fused_tokens = max(tokens)
    # a root unit set to free its gathered weights after each forward: the head would meet its shards
    module.policy.set_reshard_after_forward(True, recurse=False)
    root_resharding_head = module.logprobs.fused_head(module.policy)
    module.policy.set_reshard_after_forward(False, recurse=False)
    lit_grpo.models.output_head = lambda model: "a head not known to be linear"
    full = logps_and_gradients()
    torch.save({"fused": fused, "full": full, "most tokens with logits": (fused_tokens, max(tokens)),
                "head with a resharding root": root_resharding_head}, f"{results}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_sharded_head_gives_the_full_logits_values(tiny_model_dir, tmp_path):
    """Two FSDP2 ranks (the head in the root unit, gathered by the model's own forward, and kept after
    a generation's gathering too): the fused head's log-probs and the reduce-scattered gradients equal
    those from the model's logits; a root that frees its weights after each forward gets the logits."""
    torch.multiprocessing.spawn(
        fsdp2_worker, args=(str(tmp_path / "init"), str(tiny_model_dir), str(tmp_path / "results")), nprocs=2
    )
    for rank in range(2):
        results = torch.load(tmp_path / f"results.{rank}")
        fused_tokens, full_tokens = results["most tokens with logits"]
        assert fused_tokens <= TILE_TOKENS < full_tokens  # the fused head ran
        assert results["head with a resharding root"] is None
        close(results["fused"][0], results["full"][0])
        for fused, full in zip(results["fused"][1], results["full"][1]):
            close(fused, full, atol=1e-5)
