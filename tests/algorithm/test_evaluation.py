"""Evaluation while training: pass@k (unbiased estimator), mean@k, maj@k, reduced with torchmetrics."""

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from test_module import make_data, make_module

from lit_grpo.algorithm.evaluation import majority_correct, pass_at_k
from lit_grpo.cli import main


def test_pass_at_k_unbiased_estimator_by_hand():
    # n = 4 samples, c = 1 correct, k = 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    assert float(pass_at_k(torch.tensor([1]), 4, 2)) == pytest.approx(0.5)
    # n = 5, c = 2, k = 3: 1 - C(3, 3) / C(5, 3) = 1 - 1/10
    assert float(pass_at_k(torch.tensor([2]), 5, 3)) == pytest.approx(0.9)
    # k = 1 is the fraction correct; none correct is 0; n - c < k is 1
    assert pass_at_k(torch.tensor([0, 3, 5]), 8, 1).tolist() == pytest.approx([0.0, 3 / 8, 5 / 8])
    assert pass_at_k(torch.tensor([0, 7]), 8, 2).tolist() == pytest.approx([0.0, 1.0])
    # against the binomial formula for every c
    n, k = 8, 3
    for c in range(n + 1):
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert float(pass_at_k(torch.tensor([c]), n, k)) == pytest.approx(expected)
    with pytest.raises(ValueError, match="1 <= k <= n = 4"):
        pass_at_k(torch.tensor([1]), 4, 5)


def test_majority_vote_by_hand():
    answers = [["7", "8", "7"], ["a", "b"], ["x", "y", "y"]]
    assert majority_correct(answers[:1], torch.tensor([[True, False, True]])).tolist() == [1.0]
    # a tie goes to the first answer seen ("a", wrong); "y" wins 2:1 and is wrong
    assert majority_correct(answers[1:2], torch.tensor([[False, True]])).tolist() == [0.0]
    assert majority_correct(answers[2:], torch.tensor([[True, False, False]])).tolist() == [0.0]


class RecordingScorer:
    """Wraps a scorer and keeps what it was given and returned."""

    def __init__(self, scorer):
        self.scorer, self.weights, self.names, self.calls = scorer, scorer.weights, scorer.names, []

    def check_columns(self, columns, source):
        self.scorer.check_columns(columns, source)

    def __call__(self, prompts, completions, completion_ids, columns):
        rewards = self.scorer(prompts, completions, completion_ids, columns)
        self.calls.append((completions, rewards.clone()))
        return rewards

    def close(self):
        self.scorer.close()


def test_validation_metrics_equal_their_definitions(tiny_model_dir, write_jsonl, fast_trainer, reward_plugin):
    # a binary reward that a random model gets right about half the time
    reward_plugin(starts_low=lambda completions, **kw: [1.0 if c[:1] < "n" else 0.0 for c in completions])
    data_file = write_jsonl([{"prompt": f"Say {c}:"} for c in "abcdef"])
    pl.seed_everything(0)
    module = make_module(
        tiny_model_dir, rewards=[{"name": "starts_low"}], num_generations_eval=4, eval_pass_k=[1, 2, 4]
    )
    module.eval_scorer = RecordingScorer(module.eval_scorer)
    data = make_data(data_file, batch_size=2, val_split="train")
    results = fast_trainer().validate(module, data)[0]

    rewards = torch.cat([r.view(-1, 4) for _, r in module.eval_scorer.calls])  # [6 prompts, 4]
    texts = [c for completions, _ in module.eval_scorer.calls for c in completions]
    correct = rewards >= 1.0
    assert 0 < correct.sum() < correct.numel()  # not vacuous
    assert results["val/reward"] == pytest.approx(rewards.mean().item(), abs=1e-6)
    assert results["val/mean@4"] == pytest.approx(rewards.mean(dim=1).mean().item(), abs=1e-6)
    n_correct = correct.sum(dim=1).tolist()
    for k in (1, 2, 4):
        expected = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in n_correct) / 6
        assert results[f"val/pass@{k}"] == pytest.approx(expected, abs=1e-6)
    answers = [[" ".join(t.split()) for t in texts[4 * b : 4 * b + 4]] for b in range(6)]
    expected_maj = sum(float(correct[b][answers[b].index(max(answers[b], key=answers[b].count))]) for b in range(6)) / 6
    assert results["val/maj@4"] == pytest.approx(expected_maj, abs=1e-6)


def test_greedy_validation_samples_identical_completions(tiny_model_dir, write_jsonl, fast_trainer, reward_plugin):
    reward_plugin(half=lambda completions, **kw: [0.5] * len(completions))
    module = make_module(tiny_model_dir, rewards=[{"name": "half"}], num_generations_eval=3, temperature_eval=0.0)
    module.eval_scorer = RecordingScorer(module.eval_scorer)
    data = make_data(write_jsonl([{"prompt": "Say a:", "target": "a"}] * 2), batch_size=2, val_split="train")
    results = fast_trainer().validate(module, data)[0]
    completions = module.eval_scorer.calls[0][0]
    assert len(completions) == 6 and len(set(completions[:3])) == 1
    assert "val/maj@3" not in results  # a fraction is not a binary reward: no majority vote


def test_eval_settings_that_cannot_work(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model\.eval_pass_k value 8 must be between 1 and num_generations_eval = 4"):
        make_module(tiny_model_dir, num_generations_eval=4, eval_pass_k=[1, 8])
    with pytest.raises(ValueError, match=r"model\.temperature_eval must be >= 0"):
        make_module(tiny_model_dir, temperature_eval=-1.0)


def test_validate_subcommand_evaluates_a_checkpoint(tiny_model_dir, tmp_path, say_a_or_b_file, capsys):
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"""
trainer: {{accelerator: cpu, max_steps: 1, enable_progress_bar: false, enable_model_summary: false,
  default_root_dir: {tmp_path}, logger: false}}
model:
  model_name_or_path: {tiny_model_dir}
  num_generations: 4
  max_completion_length: 6
  num_generations_eval: 2
  rewards: [{{name: char_fraction}}]
data: {{path: json, data_files: {say_a_or_b_file}, batch_size: 2, val_split: "train[:4]"}}
"""
    )
    main(["fit", "--config", str(config)])
    checkpoint = Path(tmp_path) / "checkpoints" / "last.ckpt"
    assert checkpoint.exists()
    capsys.readouterr()
    main(["validate", "--config", str(config), "--ckpt_path", str(checkpoint)])
    out = capsys.readouterr().out
    for name in ("val/reward", "val/mean@2", "val/pass@1", "val/pass@2"):
        assert name in out, out


def test_validate_before_training_logs_the_untrained_baseline(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    module = make_module(tiny_model_dir, num_generations_eval=2, validate_before_training=True)
    validated_at = []

    class Record(pl.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            validated_at.append(trainer.global_step)

    trainer = fast_trainer(max_steps=2, callbacks=[Record()], num_sanity_val_steps=0, limit_val_batches=1)
    trainer.fit(module, make_data(say_a_or_b_file, val_split="train[:2]"))
    # 8 batches per epoch and 2 steps: Lightning itself never validates here; the callback does, at step 0
    assert validated_at == [0]
    assert "val/reward" in trainer.callback_metrics


def test_val_check_interval_validates_during_fit(tiny_model_dir, say_a_or_b_file, fast_trainer):
    pl.seed_everything(0)
    module = make_module(tiny_model_dir, num_generations_eval=2)
    validated_at = []

    class Record(pl.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            validated_at.append((trainer.global_step, float(trainer.callback_metrics["val/pass@2"])))

    trainer = fast_trainer(max_steps=4, val_check_interval=2, num_sanity_val_steps=0, limit_val_batches=1, callbacks=[Record()])
    trainer.fit(module, make_data(say_a_or_b_file, val_split="train[:2]"))
    assert [step for step, _ in validated_at] == [2, 4]
    assert all(0.0 <= value <= 1.0 for _, value in validated_at)
