"""DAPO dynamic sampling: groups without signal are dropped and replaced by the next prompts."""

import string

import lightning.pytorch as pl
import pytest
import torch
from test_distributed import STRATEGIES, run_dir, run_worker  # noqa: F401  (run_dir is a fixture)
from test_module import make_data, make_module


def gated(prompts, completions, **kwargs):
    """Constant 1.0 for "Say z:" (a group without signal), else the fraction of lowercase letters."""
    return [
        1.0 if prompt == "Say z:" else sum(c in string.ascii_lowercase for c in completion) / max(len(completion), 1)
        for prompt, completion in zip(prompts, completions)
    ]


@pytest.fixture
def recorded_fit(tiny_model_dir, write_jsonl, fast_trainer, reward_plugin):
    """``recorded_fit(rows, **module_settings) -> (trainer, [ScoredRollout per step], logged metrics per step)``."""

    def fit(rows, max_steps=2, **settings):
        reward_plugin(gated=gated)
        pl.seed_everything(0)
        module = make_module(tiny_model_dir, rewards=[{"name": "gated"}], dynamic_sampling=True, **settings)
        steps, metrics = [], []
        generate_and_score = module.generate_and_score

        def recording(batch, training=True):
            scored, completions = generate_and_score(batch, training)
            steps.append(scored)
            return scored, completions

        module.generate_and_score = recording

        class Metrics(pl.Callback):
            def on_train_batch_end(self, trainer, *args):
                metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

        trainer = fast_trainer(max_steps=max_steps, callbacks=[Metrics()])
        trainer.fit(module, make_data(write_jsonl(rows), batch_size=2, shuffle=False))
        return trainer, steps, metrics

    return fit


def test_groups_without_signal_are_replaced_by_the_next_prompts(recorded_fit):
    rows = [{"prompt": p} for p in ["Say z:", "Say a:", "Say z:", "Say b:", "Say c:", "Say z:", "Say d:", "Say e:"]]
    trainer, steps, metrics = recorded_fit(rows)
    # step 1: [z, a] has one informative group; the next batch [z, b] supplies the second
    assert steps[0].prompts == ["Say a:", "Say b:"]
    assert metrics[0]["dynamic_sampling/rounds"] == 2
    assert metrics[0]["dynamic_sampling/dropped_frac"] == pytest.approx(2 / 4)
    # step 2 continues the stream after what step 1 consumed: [c, z] then [d, e]
    assert steps[1].prompts == ["Say c:", "Say d:"]
    assert metrics[1]["dynamic_sampling/rounds"] == 2
    assert metrics[1]["dynamic_sampling/dropped_frac"] == pytest.approx(1 / 4)
    for scored in steps:
        assert not scored.group.zero_std.any()  # every trained group carries signal
        assert scored.rollout.completion_ids.size(0) == 2 * 4  # batch_size groups of G


def test_max_generation_rounds_tops_the_batch_up_with_uninformative_groups(recorded_fit):
    rows = [{"prompt": "Say z:"}] * 8 + [{"prompt": "Say a:"}] * 2
    trainer, steps, metrics = recorded_fit(rows, max_steps=1, max_generation_rounds=3)
    assert metrics[0]["dynamic_sampling/rounds"] == 3
    assert metrics[0]["dynamic_sampling/dropped_frac"] == 1.0
    assert steps[0].prompts == ["Say z:", "Say z:"]  # the step still has batch_size groups
    assert torch.equal(steps[0].group.advantages, torch.zeros(8))
    assert trainer.global_step == 1  # and still makes its optimizer step


def test_dynamic_sampling_on_two_processes_keeps_ranks_in_step(run_dir):  # noqa: F811
    """Ranks that need different numbers of rounds still run the same rounds and optimizer steps."""
    overrides = {
        "trainer": {"devices": 2, "strategy": STRATEGIES["ddp"]},
        "data": {"batch_size": 2, "shuffle": False},
        "model": {"dynamic_sampling": True, "max_generation_rounds": 3, "rewards": [{"name": "gated"}]},
    }
    result = run_worker(run_dir, "dynamic", 2, overrides, "--fixed-completions", "--gated-reward")
    steps = result["steps"]
    assert len(steps) == 2  # 2 training steps (num_iterations 2: 4 optimizer steps), no deadlock
    # global batches [0 1 2 3], [4 5 6 7], [8 9 10 11]: prompts 0, 3, 6, 9 have no signal
    assert steps[0]["dynamic_sampling/rounds"] == 2
    assert steps[0]["dynamic_sampling/dropped_frac"] == pytest.approx(3 / 8)


def test_a_lightning_without_the_data_fetcher_is_refused_before_the_first_step(tiny_model_dir, write_jsonl, fast_trainer, reward_plugin):
    """Dynamic sampling pulls batches through ``fit_loop._data_fetcher`` (no public interface): a
    Lightning without it fails at the start of training, naming the setting, not mid-run."""
    reward_plugin(gated=gated)
    module = make_module(tiny_model_dir, rewards=[{"name": "gated"}], dynamic_sampling=True)

    class LightningWithoutFetcher(pl.Callback):  # callbacks' on_train_start runs before the module's
        def on_train_start(self, trainer, pl_module):
            trainer.fit_loop._data_fetcher = None

    generated = []
    module.generate_and_score = lambda *args, **kwargs: generated.append(1)
    trainer = fast_trainer(max_steps=1, callbacks=[LightningWithoutFetcher()])
    with pytest.raises(RuntimeError, match=r"model.dynamic_sampling draws further prompt batches .*_data_fetcher"):
        trainer.fit(module, make_data(write_jsonl([{"prompt": "Say a:"}] * 4), batch_size=2))
    assert generated == [] and trainer.global_step == 0
