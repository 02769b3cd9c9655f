"""share_prompt_forward: each distinct prompt encoded once in the log-prob forwards, its completions
attending to its KV cache (lit_grpo.train.shared_prompt). The reference is one plain padded forward."""

import pytest
import torch
from conftest import logps_entropy_grads, set_hparams

import lit_grpo.train.logprob_passes
import lit_grpo.train.module
from lit_grpo.rollout.records import Rollout
from lit_grpo.train.module import GRPOModule
from lit_grpo.train.shared_prompt import distinct_prompts, shared_prompt_unsupported

REWARDS = [{"name": "char_fraction", "args": {"chars": "a"}}]


def test_distinct_prompts_by_hand():
    # rows 0, 2: prompt A; rows 1, 4: prompt B; row 3 has A's ids but one more masked column
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]])
    groups = distinct_prompts(prompt_ids, prompt_mask)
    assert groups.first_row.tolist() == [0, 1, 3]  # in order of first appearance
    assert groups.row_prompt.tolist() == [0, 1, 0, 2, 1]
    assert groups.saved_tokens(prompt_width=3) == (5 - 3) * 3


@pytest.fixture
def module(tiny_model_dir):
    torch.manual_seed(0)
    module = GRPOModule(str(tiny_model_dir), rewards=REWARDS, num_generations=4, max_completion_length=9)
    module.configure_model()
    return module


def hand_made_rollout(tokenizer, completion_lengths, order) -> Rollout:
    """Three prompts of different lengths (left-padded), 4 rows each in the given row order, with
    completions of the given lengths (EOS last, padding after)."""
    prompts = tokenizer(["a:", "Say a:", "Please say the letter b:"], padding=True, padding_side="left", return_tensors="pt")
    g = torch.Generator().manual_seed(0)
    width = max(completion_lengths)
    completion_ids = torch.randint(3, 40, (len(order), width), generator=g)
    completion_mask = (torch.arange(width) < torch.tensor(completion_lengths)[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    rows = torch.tensor(order)
    return Rollout(
        prompts["input_ids"][rows], prompts["attention_mask"][rows], completion_ids, completion_mask,
        torch.zeros(len(order), dtype=torch.bool),
    )


def input_shapes(model):
    """Record the input_ids shape of every forward of ``model``."""
    shapes = []
    model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return shapes


@pytest.mark.parametrize("group_by_length", [False, True])
def test_shared_prompt_logps_and_gradients_equal_one_forward(module, monkeypatch, group_by_length):
    """Prompts of three lengths, rows shuffled, completions of 1 to 9 tokens: log-probs, entropy and
    gradients equal one padded forward, while the model really ran the 3 prompts once and the
    completions without their prompts and last token."""
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)  # share even this small batch
    lengths = [9, 3, 5, 1, 2, 9, 6, 4, 3, 2, 7, 1]
    rollout = hand_made_rollout(module.tokenizer, lengths, order=[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2])
    P = rollout.prompt_mask.size(1)
    reference = logps_entropy_grads(module, rollout, share_prompt_forward=False, group_by_length=False)
    set_hparams(module, forward_token_budget=30)  # with group_by_length: several chunks of completions
    shapes = input_shapes(module.policy)
    shared = logps_entropy_grads(module, rollout, share_prompt_forward=True, group_by_length=group_by_length)

    assert shapes[0] == (3, P)  # the distinct prompts, once
    assert all(width <= 9 - 1 for _, width in shapes[1:])  # completions only, last token dropped
    assert sum(rows for rows, _ in shapes[1:]) == 12
    if group_by_length:
        assert len(shapes) > 2
    mask = rollout.completion_mask.bool()
    assert shared[0].shape == reference[0].shape
    torch.testing.assert_close(shared[0][mask], reference[0][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[1][mask], reference[1][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared[2], reference[2], atol=1e-5, rtol=1e-4)


def test_single_token_completions_need_only_the_prompt_forward(module, monkeypatch):
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    rollout = hand_made_rollout(module.tokenizer, [1] * 6, order=[2, 2, 2, 0, 0, 0])
    reference = logps_entropy_grads(module, rollout, share_prompt_forward=False, group_by_length=False)
    shapes = input_shapes(module.policy)
    shared = logps_entropy_grads(module, rollout, share_prompt_forward=True, group_by_length=True)
    assert shapes == [(2, rollout.trimmed().prompt_mask.size(1))]
    for got, expected in zip(shared, reference):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_prompts_are_not_shared_where_that_saves_less_than_a_forward(module):
    """12 rows of 3 prompts save 9 x P prompt tokens, less than FORWARD_OVERHEAD_TOKENS (256): one forward."""
    rollout = hand_made_rollout(module.tokenizer, [4] * 12, order=[0, 1, 2] * 4)
    assert 9 * rollout.trimmed().prompt_mask.size(1) <= lit_grpo.train.logprob_passes.FORWARD_OVERHEAD_TOKENS
    shapes = input_shapes(module.policy)
    logps_entropy_grads(module, rollout, share_prompt_forward=True, group_by_length=True)
    assert shapes == [(12, rollout.trimmed().prompt_mask.size(1) + 4 - 1)]  # prompt + completion but its last token


def test_gradient_checkpointing_turns_sharing_off_and_says_why(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    messages = []
    monkeypatch.setattr(lit_grpo.train.logprob_passes, "rank_zero_info", messages.append)
    module = GRPOModule(str(tiny_model_dir), rewards=REWARDS, num_generations=4, gradient_checkpointing=True)
    module.configure_model()
    assert shared_prompt_unsupported(module.policy) == "gradient checkpointing"
    rollout = hand_made_rollout(module.tokenizer, [3, 2, 5, 4] * 3, order=[0, 1, 2] * 4)
    shapes = input_shapes(module.policy)
    for _ in range(2):
        logps, _ = module.logprobs.completion_logps(module.policy, rollout)
    assert all(rows == 12 for rows, _ in shapes)  # every row with its prompt
    assert logps.isfinite().all()
    assert messages == ["model.share_prompt_forward: prompts are encoded with every completion (gradient checkpointing)"]


def test_sliding_window_models_are_not_shared(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shared_prompt_unsupported(model) is None
    model.config.layer_types = ["sliding_attention"] + ["full_attention"] * (model.config.num_hidden_layers - 1)
    assert shared_prompt_unsupported(model) == "layer types ['full_attention', 'sliding_attention']"


def test_training_step_is_the_same_with_and_without_shared_prompts(tiny_model_dir, say_a_or_b_file, fast_trainer, monkeypatch):
    """A whole GRPO step (beta > 0, two iterations, micro-batches, length chunks) gives the same loss,
    KL and weights whether prompts are shared or every row runs its prompt."""
    import lightning.pytorch as pl

    from lit_grpo.data import GRPODataModule

    monkeypatch.setattr(lit_grpo.train.logprob_passes, "FORWARD_OVERHEAD_TOKENS", 0)
    encoded = []  # (rows, distinct prompts) of every shared prompt forward
    encode_prompts = lit_grpo.train.logprob_passes.encode_prompts

    def counting_encode_prompts(model, prompt_ids, prompt_mask, groups, *head):
        encoded.append((prompt_ids.size(0), groups.first_row.numel()))
        return encode_prompts(model, prompt_ids, prompt_mask, groups, *head)

    monkeypatch.setattr(lit_grpo.train.logprob_passes, "encode_prompts", counting_encode_prompts)

    def train(share):
        pl.seed_everything(0, verbose=False)
        module = GRPOModule(
            str(tiny_model_dir), rewards=REWARDS, num_generations=4, max_completion_length=12, beta=0.1,
            num_iterations=2, micro_batch_size=6, share_prompt_forward=share, log_completions_every_n_steps=0,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        )
        module.configure_model()
        module.generation_config.sequence_bias = {(module.tokenizer.eos_token_id,): 2.0}  # lengths vary
        logged = {}
        module.log = lambda name, value, **kwargs: logged.setdefault(name, []).append(float(value))
        data = GRPODataModule(path="json", data_files=str(say_a_or_b_file), batch_size=3, seed=0)
        fast_trainer(max_steps=3).fit(module, datamodule=data)
        weights = torch.cat([p.detach().flatten() for p in module.policy.parameters()])
        return logged, weights

    plain, weights = train(False)
    assert encoded == []
    shared, shared_weights = train(True)
    # 2 generation batches (2 optimizer steps each: max_steps=3 ends after the second), each with
    # 6 forwards of a micro-batch of 6 rows: reference log-probs (2), 2 iterations x 2 (the first
    # iteration's forwards give the old log-probs). 6 rows span 2 groups of 4, whose prompts are 2
    # distinct ones, or 1 where "Say a:" came twice
    assert len(encoded) == 2 * 6
    assert {rows for rows, _ in encoded} == {6} and {prompts for _, prompts in encoded} <= {1, 2}
    assert (6, 2) in encoded
    for name in ("loss", "kl", "entropy", "reward", "completions/mean_length"):
        torch.testing.assert_close(torch.tensor(shared[name]), torch.tensor(plain[name]), atol=1e-5, rtol=1e-4)
    assert (weights != 0).any()
    torch.testing.assert_close(shared_weights, weights, atol=1e-5, rtol=1e-4)
