"""Padding-free forwards (issue 53.2, ``model.padding_free``): the rows of each log-prob forward packed
into one sequence give the padded forward's log-probs, entropies, loss and every parameter's gradient
(fused LM head and full logits, tied and untied heads, LoRA, temperature and the sampling filters,
bf16 autocast), while the model really sees one sequence of the real tokens only; a model whose
attention cannot keep packed rows apart is refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import logps_entropy_grads, set_hparams
from test_distributed import run_dir  # noqa: F401 - the two-process runs' directory (a fixture)
from test_shared_prompt import REWARDS, hand_made_rollout
from transformers import AutoConfig, AutoModelForCausalLM

import lit_grpo.algorithm.fused_lm_head
import lit_grpo.models
import lit_grpo.train.logprob_passes
from lit_grpo.algorithm import GroupAdvantages
from lit_grpo.errors import ConfigError
from lit_grpo.rollout.records import ScoredRollout
from lit_grpo.train.module import GRPOModule

FILTERS = {
    "temperature": dict(temperature=0.7),
    "top-k, top-p, min-p and the penalty": dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
}
LENGTHS = [9, 3, 5, 1, 2, 9, 6, 4, 3, 2, 7, 1]  # ragged completions, prompts of three lengths (left-padded)
ORDER = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]
TILE_TOKENS = 3


def close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def input_shapes(model) -> list[tuple]:
    """The ``input_ids`` shape of every forward of ``model``."""
    shapes = []
    model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return shapes


def build(model_dir_or_model, monkeypatch, fused_head=True, **options) -> GRPOModule:
    """The policy in float32; with ``fused_head`` its passes score tiles of 3 tokens (the fused head
    runs), else every head is 'unknown' and the model's logits are asked for."""
    torch.manual_seed(0)
    module = GRPOModule(model_dir_or_model if isinstance(model_dir_or_model, torch.nn.Module) else str(model_dir_or_model),
                        rewards=REWARDS, num_generations=4, max_completion_length=9, **options)
    module.configure_model()
    module.policy.float()
    if fused_head:
        vocab_size = module.policy.config.vocab_size
        monkeypatch.setattr(lit_grpo.algorithm.fused_lm_head, "LOGITS_TILE_BYTES", TILE_TOKENS * 4 * vocab_size)
    else:
        monkeypatch.setattr(lit_grpo.models, "output_head", lambda model: "a head not known to be linear")
    return module


def padded_and_packed(module, rollout, **settings):
    """``logps_entropy_grads`` with ``padding_free`` false, then true (one forward over every row,
    no shared prompt); asserts the packed forward was one sequence of the rows' real tokens."""
    settings = dict(share_prompt_forward=False, group_by_length=False, **settings)
    padded = logps_entropy_grads(module, rollout, padding_free=False, **settings)
    shapes = input_shapes(module.policy)
    packed = logps_entropy_grads(module, rollout, padding_free=True, **settings)
    real_tokens = int(rollout.trimmed().prompt_mask.sum() + rollout.completion_mask[:, :-1].sum())
    assert shapes == [(1, real_tokens)]
    return padded, packed


def assert_equal_values(padded, packed, mask, gradient_atol=1e-5):
    close(packed[0][mask], padded[0][mask])
    close(packed[1][mask], padded[1][mask])
    assert packed[2].abs().max() > 0
    # every weight's gradient, summed over all tokens: float32 sums in another order (test_module's micro-batching rtol)
    close(packed[2], padded[2], rtol=1e-4, atol=gradient_atol)


@pytest.mark.parametrize("fused_head", [True, False], ids=["fused head", "full logits"])
@pytest.mark.parametrize("filters", list(FILTERS))
def test_packed_equals_padded_on_a_tied_head(tiny_model_dir, monkeypatch, fused_head, filters):
    module = build(tiny_model_dir, monkeypatch, fused_head)
    assert module.policy.config.tie_word_embeddings
    rollout = hand_made_rollout(module.tokenizer, LENGTHS, ORDER)
    padded, packed = padded_and_packed(module, rollout, **FILTERS[filters])
    assert_equal_values(padded, packed, rollout.completion_mask.bool())


def test_packed_length_chunks_count_real_tokens_and_equal_one_padded_forward(tiny_model_dir, monkeypatch):
    module = build(tiny_model_dir, monkeypatch)
    rollout = hand_made_rollout(module.tokenizer, LENGTHS, ORDER)
    padded = logps_entropy_grads(module, rollout, padding_free=False, group_by_length=False, share_prompt_forward=False)
    shapes = input_shapes(module.policy)
    packed = logps_entropy_grads(module, rollout, padding_free=True, group_by_length=True, forward_token_budget=60)
    assert len(shapes) > 1 and all(rows == 1 and tokens <= 60 for rows, tokens in shapes)  # chunks of real tokens
    real_tokens = int(rollout.prompt_mask.sum() + rollout.completion_mask.sum())
    assert real_tokens - len(LENGTHS) <= sum(tokens for _, tokens in shapes) < real_tokens  # no padding (each chunk's last column left out)
    assert_equal_values(padded, packed, rollout.completion_mask.bool())


@pytest.fixture(scope="module")
def untied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with an output head of its own (random), not its embeddings."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("untied")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


@pytest.mark.parametrize("fused_head", [True, False], ids=["fused head", "full logits"])
def test_packed_equals_padded_on_an_untied_head(untied_model_dir, monkeypatch, fused_head):
    module = build(untied_model_dir, monkeypatch, fused_head)
    assert not module.policy.config.tie_word_embeddings
    rollout = hand_made_rollout(module.tokenizer, LENGTHS, ORDER)
    padded, packed = padded_and_packed(module, rollout, **FILTERS["temperature"])
    assert_equal_values(padded, packed, rollout.completion_mask.bool())


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # the tiny model ties its head: peft says so
def test_packed_equals_padded_with_lora_and_for_the_reference(tiny_model_dir, monkeypatch):
    lora = {"target_modules": ["q_proj", "v_proj", "lm_head"], "r": 4, "init_lora_weights": False}
    module = build(tiny_model_dir, monkeypatch, lora=lora)
    rollout = hand_made_rollout(module.tokenizer, LENGTHS, ORDER)
    padded, packed = padded_and_packed(module, rollout)
    assert_equal_values(padded, packed, rollout.completion_mask.bool())
    references = []
    for padding_free in (False, True):  # the policy with its adapter disabled, through logps_no_grad
        set_hparams(module, padding_free=padding_free)
        references.append(module.logprobs.reference_logps(module.policy, None, rollout))
    mask = rollout.completion_mask.bool()
    close(references[1][mask], references[0][mask])
    assert not torch.allclose(references[1][mask], packed[0][mask])  # the adapter was really off


def test_bf16_autocast_within_the_bf16_tolerance(tiny_model_dir, monkeypatch):
    module = build(tiny_model_dir, monkeypatch)
    rollout = hand_made_rollout(module.tokenizer, LENGTHS, ORDER)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        padded, packed = padded_and_packed(module, rollout)
    float32 = logps_entropy_grads(module, rollout, padding_free=False)
    mask = rollout.completion_mask.bool()
    # tests/algorithm/test_fused_lm_head.py's bf16 tolerance (measured here: equal log-probs, gradients within 6e-5)
    close(packed[0][mask], padded[0][mask], rtol=1e-3, atol=1e-3)
    close(packed[1][mask], padded[1][mask], rtol=1e-3, atol=1e-3)
    # packed bf16 is as far from float32 as padded bf16 is (the same bf16 rounding, not another error)
    packed_error = (packed[0][mask] - float32[0][mask]).abs().max()
    padded_error = (padded[0][mask] - float32[0][mask]).abs().max()
    assert packed_error < 2 * padded_error + 1e-3
    close(packed[2], padded[2], rtol=1e-2, atol=1e-2)


def scored_rollout(rollout) -> ScoredRollout:
    """The rows with advantages ``[-1.5 .. 1.5]``, every completion token in the loss."""
    n = rollout.completion_ids.size(0)
    loss_mask = rollout.completion_mask.float()
    advantages = torch.linspace(-1.5, 1.5, n)
    group = GroupAdvantages(advantages, torch.zeros(n), torch.ones(n), torch.zeros(n, dtype=torch.bool))
    return ScoredRollout(rollout=rollout, loss_mask=loss_mask, rewards_per_func=torch.zeros(n, 1), rewards=torch.zeros(n),
                         group=group, old_logps=None, ref_logps=None, num_items_in_batch=float(loss_mask.sum()),
                         timings={}, prompts=[])


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_the_loss_and_every_gradient_of_a_micro_batch_equal_the_padded(untied_model_dir, monkeypatch, gradient_checkpointing):
    """micro_batch_backward (length chunks within a budget, rows without gradient skipped) packs each
    chunk; its loss and every parameter's gradient are the padded run's."""
    module = build(untied_model_dir, monkeypatch, gradient_checkpointing=gradient_checkpointing)
    module.logprobs.backward = lambda loss, sync: loss.backward()  # no trainer: autograd's own
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)  # skip even these short rows
    scored = scored_rollout(hand_made_rollout(module.tokenizer, LENGTHS, ORDER))
    scored.group.advantages[[2, 7]] = 0.0  # rows without gradient: a forward without autograd, packed too
    frozen_passes = []  # whether autograd was on in each pass over the rows without gradient
    completion_logps = module.logprobs.completion_logps

    def counted(*args, **kwargs):
        frozen_passes.append(torch.is_grad_enabled())
        return completion_logps(*args, **kwargs)

    monkeypatch.setattr(module.logprobs, "completion_logps", counted)
    rows = torch.arange(len(LENGTHS))
    results = []
    shapes = input_shapes(module.policy)
    forwards = []
    for padding_free in (False, True):
        set_hparams(module, padding_free=padding_free, share_prompt_forward=False, forward_token_budget=60)
        module.policy.zero_grad(set_to_none=True)
        shapes.clear()
        stats, logps = module.logprobs.micro_batch_backward(module.policy, scored, rows, scale=1.0, sync=True)
        grads = {name: p.grad.clone() for name, p in module.policy.named_parameters() if p.grad is not None}
        results.append((stats["loss"], logps, grads))
        forwards.append(len(shapes))
    assert len(shapes) > 1 and all(rows == 1 for rows, _ in shapes)  # the packed run: chunks, each one sequence
    assert all(tokens <= 60 for _, tokens in shapes)  # each within the budget in real tokens,
    assert forwards[1] < forwards[0]  # so fewer forwards than chunks counted with their padding
    assert frozen_passes == [False, False]  # each run's rows without gradient went forward apart, without autograd
    (padded_loss, padded_logps, padded_grads), (packed_loss, packed_logps, packed_grads) = results
    close(packed_loss, padded_loss)
    mask = scored.loss_mask[:, : padded_logps.size(1)].bool()
    close(packed_logps[mask], padded_logps[mask])
    assert packed_grads.keys() == padded_grads.keys() and len(packed_grads) == len(list(module.policy.parameters()))
    for name, gradient in padded_grads.items():
        close(packed_grads[name], gradient, rtol=1e-4, atol=1e-6)


def sliding_window_model():
    config = AutoConfig.for_model("mistral", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_padding_free_true_on_a_model_that_cannot_pack_is_one_line_naming_its_attention(tiny_model_dir, monkeypatch):
    module = build(tiny_model_dir, monkeypatch)
    rollout = hand_made_rollout(module.tokenizer, LENGTHS[:3], ORDER[:3])
    set_hparams(module, padding_free=True, share_prompt_forward=False)
    module.policy.config._attn_implementation = "paged|eager"  # paged attention: no packed rows
    with pytest.raises(ConfigError, match=r"^model.padding_free: true .*attention implementation 'paged\|eager'"):
        module.logprobs.completion_logps(module.policy, rollout)
    set_hparams(module, padding_free="auto")  # auto, where the device would pack: the padded forward
    module.logprobs.device_defaults = dict(module.logprobs.device_defaults, padding_free=True)
    logps, _ = module.logprobs.completion_logps(module.policy, rollout)
    assert logps.shape[0] == 3


def test_a_sliding_window_model_is_refused(monkeypatch):
    from lit_grpo.train.packed_forward import check_packing

    with pytest.raises(ConfigError, match=r"MistralForCausalLM \(attention 'sdpa'\) has sliding-window attention"):
        check_packing(sliding_window_model())


def test_fsdp2_packed_run_equals_the_padded_run(run_dir):
    """Two FSDP2 processes (gloo), micro-batches in length chunks of rows: the packed run's losses,
    metrics and updated weights equal the padded run's (the ranks agree on the number of forwards)."""
    from test_distributed import COMPARED_METRICS, GLOBAL_BATCH, STRATEGIES, start_worker

    runs = {}
    for padding_free in (False, True):
        name = f"fsdp2_padding_free_{padding_free}"
        overrides = {"trainer": {"devices": 2, "strategy": STRATEGIES["fsdp2"], "max_steps": 2},
                     "data": {"batch_size": GLOBAL_BATCH // 2},
                     "model": {"padding_free": padding_free, "share_prompt_forward": False, "forward_token_budget": 30}}
        result = start_worker(run_dir, name, 2, overrides, "--fixed-completions")
        assert result.returncode == 0, f"{name} failed:\n{result.stderr[-6000:]}"
        said = "model.padding_free: the rows of each log-prob forward go through the model as one sequence"
        assert (said in result.stderr + result.stdout) == padding_free
        runs[padding_free] = torch.load(run_dir / f"{name}.pt", weights_only=False)
    padded, packed = runs[False], runs[True]
    assert len(packed["steps"]) == len(padded["steps"]) == 1
    assert 2 < packed["backward_passes"] <= padded["backward_passes"]  # chunks of real tokens: as many or fewer
    for name in COMPARED_METRICS:
        assert packed["steps"][0][name] == pytest.approx(padded["steps"][0][name], rel=1e-4, abs=1e-6), name
    # float32 sums in another order; Adam (lr 0.01) turns that rounding into weight differences of ~4e-5
    # (as test_distributed's chunked runs), where a wrong row or position would move weights by ~1e-2
    for name, expected in padded["state"].items():
        torch.testing.assert_close(packed["state"][name], expected, rtol=1e-4, atol=1e-4, msg=name)


def test_packed_chunks_are_split_to_the_number_of_forwards_the_ranks_agreed_on(tiny_model_dir, monkeypatch):
    """Under FSDP2 every rank runs as many forwards as the rank with the most chunks (else the ranks
    hang in the sharded forward): the packed chunks of the log-prob passes and of a micro-batch's
    backward are split to the agreed number too. One process, the agreement said to be 2 more."""
    from lit_grpo.train.packing import token_budget_chunks

    module = build(tiny_model_dir, monkeypatch)
    rollout = hand_made_rollout(module.tokenizer, LENGTHS, ORDER)
    set_hparams(module, padding_free=True, group_by_length=True, share_prompt_forward=False, forward_token_budget=60)
    own = len(token_budget_chunks(rollout.prompt_mask.sum(dim=1) + rollout.completion_mask.sum(dim=1), 60))
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "agreed_over_sharded_ranks",
                        lambda count, model, reduce: count + 2 if reduce == "max" else count)
    shapes = input_shapes(module.policy)
    with torch.no_grad():
        module.logprobs.completion_logps(module.policy, rollout)
    assert len(shapes) == own + 2 and all(rows == 1 for rows, _ in shapes)  # packed forwards, as many as agreed
    chunks = module.logprobs.backward_chunks(module.policy, rollout, None)
    assert len(chunks) == own + 2 and sorted(torch.cat(chunks).tolist()) == list(range(len(LENGTHS)))


def test_a_model_type_not_known_to_mask_packed_rows_apart_is_refused(monkeypatch):
    """GPT-2 on sdpa: an attention implementation that packs, but a model type not listed as building
    its mask from the position ids."""
    from lit_grpo.train.packed_forward import check_packing

    config = AutoConfig.for_model("gpt2", vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ConfigError, match=r"^model.padding_free: true .*GPT2LMHeadModel \(model_type 'gpt2', attention "
                                          r"'sdpa'\) is not known to mask packed rows apart"):
        check_packing(model)


def test_padding_free_true_is_refused_when_the_optimizer_is_built_before_any_sampling(tiny_model_dir, monkeypatch):
    module = build(tiny_model_dir, monkeypatch, padding_free=True)
    module.configure_optimizers()  # sdpa on a Llama: packs
    module.policy.config._attn_implementation = "paged|eager"
    with pytest.raises(ConfigError, match=r"^model.padding_free: true .*attention implementation 'paged\|eager'"):
        module.configure_optimizers()


def test_flash_attention_gets_the_rows_cu_seqlens_and_auto_packs_on_cuda_only_with_it(tiny_model_dir, monkeypatch):
    from lit_grpo.device_defaults import device_defaults
    from lit_grpo.train.packed_forward import packed_inputs

    module = build(tiny_model_dir, monkeypatch)
    input_ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    _, sdpa = packed_inputs(module.policy, input_ids, mask)
    assert sdpa.keys() == {"input_ids", "position_ids", "attention_mask", "use_cache"} and sdpa["attention_mask"] is None
    module.policy.config._attn_implementation = "flash_attention_2"
    packed, flash = packed_inputs(module.policy, input_ids, mask)
    assert flash["cu_seq_lens_q"].tolist() == flash["cu_seq_lens_k"].tolist() == [0, 2, 5]
    assert flash["max_length_q"] == flash["max_length_k"] == 3 and flash["position_ids"].tolist() == [[0, 1, 0, 1, 2]]
    config = module.policy.config
    assert device_defaults(torch.device("cuda"), config, free_bytes=2**34)["padding_free"] is True
    config._attn_implementation = "sdpa"
    assert device_defaults(torch.device("cuda"), config, free_bytes=2**34)["padding_free"] is False
    assert device_defaults(torch.device("cpu"), config)["padding_free"] is False
