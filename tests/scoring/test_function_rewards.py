"""Rewards as plain Python functions, as TRL users write them: ``path/to/file.py:function`` (beside
the config file or in the working directory) or ``package.module:function``, with ``weight`` and
``args`` as for registered rewards; and run settings a reward may take by name."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest
import yaml

from lit_grpo import plugins
from lit_grpo.cli import main, run_cli
from lit_grpo.plugins import UnknownRewardError
from lit_grpo.scoring import RewardScorer, build_reward
from lit_grpo.scoring.arguments import RewardArgumentError
from lit_grpo.scoring.specs import metric_names

REWARDS_PY = textwrap.dedent(
    '''
    def starts_with(completions, prefix="a", **kwargs):
        """1.0 where the completion starts with ``prefix``."""
        return [1.0 if c.startswith(prefix) else 0.0 for c in completions]

    def _private(completions, **kwargs):
        return [0.0] * len(completions)

    NOT_A_FUNCTION = 3
    '''
)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-grpo"])
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def scores(name: str, completions: list[str], args=None) -> list[float]:
    scorer = RewardScorer([{"name": name, "weight": 2.0, "args": args or {}}])
    try:
        return scorer(["p"] * len(completions), completions, [[1]] * len(completions), {}).squeeze(1).tolist()
    finally:
        scorer.close()


def test_a_function_from_a_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    assert scores("my_rewards.py:starts_with", ["abc", "xbc"]) == [1.0, 0.0]
    assert scores("my_rewards.py:starts_with", ["abc", "xbc"], {"prefix": "x"}) == [0.0, 1.0]
    info = plugins.get_reward(str(tmp_path / "my_rewards.py") + ":starts_with")  # absolute paths too
    assert info.doc == "1.0 where the completion starts with ``prefix``." and info.package == str(tmp_path / "my_rewards.py")
    assert "starts_with" not in plugins.get_rewards()  # `lit-grpo rewards` lists registered plugins only
    with pytest.raises(RewardArgumentError, match=r"unexpected argument 'prefx' in args \(did you mean 'prefix'\?\)"):
        build_reward("my_rewards.py:starts_with", {"prefx": "a"})


def test_a_function_of_an_importable_module(tmp_path, monkeypatch):
    (tmp_path / "team_rewards.py").write_text(REWARDS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert scores("team_rewards:starts_with", ["abc"]) == [1.0]


def test_wrong_paths_and_names_are_errors_that_name_them(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownRewardError, match=r"reward 'missing.py:starts_with': no file 'missing.py' \(looked for .*missing.py\)"):
        plugins.get_reward("missing.py:starts_with")
    with pytest.raises(UnknownRewardError, match=r"my_rewards.py has no function 'start_with'; did you mean 'starts_with'\? its functions: starts_with$"):
        plugins.get_reward("my_rewards.py:start_with")
    with pytest.raises(UnknownRewardError, match="has an attribute that is not callable: 'NOT_A_FUNCTION'"):
        plugins.get_reward("my_rewards.py:NOT_A_FUNCTION")
    with pytest.raises(UnknownRewardError, match=r"reward 'no_such_module:f': cannot import module 'no_such_module'"):
        plugins.get_reward("no_such_module:f")
    (tmp_path / "broken.py").write_text("raise RuntimeError('oops')\n")
    with pytest.raises(UnknownRewardError, match=r"running .*broken.py raised RuntimeError: oops"):
        plugins.get_reward("broken.py:f")


def test_a_file_beside_the_config_is_found_from_another_working_directory(tmp_path, monkeypatch, tiny_model_dir, say_a_or_b_file):
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "my_rewards.py").write_text(REWARDS_PY)
    config = {
        "trainer": {"max_steps": 1, "accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                    "default_root_dir": str(tmp_path)},
        "model": {"model_name_or_path": str(tiny_model_dir), "num_generations": 2, "max_completion_length": 4,
                  "rewards": [{"name": "my_rewards.py:starts_with", "weight": 0.5, "args": {"prefix": "b"}}]},
        "data": {"path": "json", "data_files": str(say_a_or_b_file), "batch_size": 2},
    }
    (recipe / "config.yaml").write_text(yaml.safe_dump(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cli = run_cli(["--config", str(recipe / "config.yaml")], run=False)
    try:
        assert cli.model.scorer.specs[0].name == f"{recipe / 'my_rewards.py'}:starts_with"
        assert cli.model.scorer.weights.tolist() == [0.5]
        assert cli.model.scorer.rewards[0].keywords == {"prefix": "b"}
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert "rewards/starts_with/mean" in cli.trainer.callback_metrics
    finally:
        cli.model.scorer.close()


def test_rewards_are_named_by_their_function_and_told_apart_only_on_a_clash():
    assert metric_names(["my_rewards.py:accuracy", "/abs/path/to/format.py:think_format", "pkg.rewards:length"]) == [
        "accuracy", "think_format", "length"]  # as TRL names them
    # a function named like a plugin gets its file's stem or its module; the plugin keeps its name
    assert metric_names(["char_fraction", "mine/char_fraction_v2.py:char_fraction", "pkg.mod:char_fraction"]) == [
        "char_fraction", "char_fraction_v2:char_fraction", "pkg.mod:char_fraction"]
    # two files of the same name: each as configured; the rest keep their short names
    assert metric_names(["a/rewards.py:score", "b/rewards.py:score", "b/rewards.py:other"]) == [
        "a/rewards.py:score", "b/rewards.py:score", "other"]


def test_metrics_and_completions_name_function_rewards_by_function(tmp_path, monkeypatch, tiny_model_dir, say_a_or_b_file, capsys):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "clash.py").write_text("def char_fraction(completions, **kwargs):\n    return [0.5] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    config = {
        "trainer": {"max_steps": 1, "accelerator": "cpu", "enable_checkpointing": False, "log_every_n_steps": 1,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}},
        "model": {"model_name_or_path": str(tiny_model_dir), "num_generations": 2, "max_completion_length": 4,
                  "log_completions_every_n_steps": 1, "print_completions": 1,
                  "rewards": [{"name": "my_rewards.py:starts_with"}, {"name": "char_fraction"},
                              {"name": f"{tmp_path}/mine/clash.py:char_fraction"}]},
        "data": {"path": "json", "data_files": str(say_a_or_b_file), "batch_size": 2},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    cli = run_cli(["--config", str(tmp_path / "config.yaml")], run=False)
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        cli.model.scorer.close()
    names = ["starts_with", "char_fraction", "clash:char_fraction"]
    assert [key for key in cli.trainer.callback_metrics if key.endswith("/mean") and key.startswith("rewards/")] == [
        f"rewards/{name}/mean" for name in names]
    assert "| prompt | completion | starts_with | char_fraction | clash:char_fraction | reward | advantage |" in capsys.readouterr().out
    records = [json.loads(line) for line in next(tmp_path.rglob("completions.jsonl")).read_text().splitlines()]
    assert len(records) == 4 and all(list(record["rewards"]) == names for record in records)
    assert [record["rewards"]["clash:char_fraction"] for record in records] == [0.5] * 4


def test_a_reward_that_raises_names_the_sample_its_own_frames_and_on_error(tmp_path, monkeypatch, tiny_model_dir,
                                                                          say_a_or_b_file, capsys):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(
        """
        def no_b(completions, target, **kwargs):
            return list(map(check, completions, target))

        def check(completion, letter):
            if letter == "b":
                raise ValueError(f"no b: {completion!r}")
            return 1.0
        """
    ))
    monkeypatch.chdir(tmp_path)
    config = {
        "trainer": {"max_steps": 1, "accelerator": "cpu", "logger": False, "enable_checkpointing": False},
        "model": {"model_name_or_path": str(tiny_model_dir), "num_generations": 2, "max_completion_length": 4,
                  "rewards": [{"name": "char_fraction"}, {"name": "my_rewards.py:no_b"}]},
        "data": {"path": "json", "data_files": str(say_a_or_b_file), "batch_size": 4},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(tmp_path / "config.yaml")])
    err = capsys.readouterr().err
    lines = err[err.index("error: "):].splitlines()
    head = re.fullmatch(rf"error: Reward 'my_rewards.py:no_b' \({tmp_path}/my_rewards.py\) raised ValueError: no b: (.*)", lines[0])
    sample = re.fullmatch(r"  while scoring sample (\d) of 8 \(found by calling the reward again with each sample alone\)", lines[1])
    assert head and sample, lines[:2]
    assert int(sample.group(1)) > 0  # the first "Say b:" prompt of the batch, not its first sample ("Say a:")
    assert lines[2:4] == ["  prompt:     'Say b:'", f"  completion: {head.group(1)}"]
    assert lines[4:-1] == [  # the reward's own frames: none of lit-grpo's
        "  Traceback (most recent call last):",
        f'    File "{tmp_path}/my_rewards.py", line 3, in no_b',
        "      return list(map(check, completions, target))",
        f'    File "{tmp_path}/my_rewards.py", line 7, in check',
        '      raise ValueError(f"no b: {completion!r}")',
        f"  ValueError: no b: {head.group(1)}",
    ]
    assert lines[-1] == (
        "To keep training, set model.rewards[1].on_error: none (or zero): the samples it fails on then score None "
        "(or 0.0), each failure is logged, and they are counted in rewards/<name>/errors."
    )


def test_trl_reward_functions_work_by_name():
    pytest.importorskip("trl.rewards")
    # TRL 1.16's format rewards read conversational completions only, [{"role": "assistant", "content": ...}],
    # which is what a run with chat prompts hands every reward (lit_grpo.rollout.records.as_completions)
    scorer = RewardScorer([{"name": "trl.rewards:think_format_reward", "weight": 2.0, "args": {}}])
    prompts = [[{"role": "user", "content": "p"}]] * 2
    completions = [[{"role": "assistant", "content": text}] for text in ["<think>\nhm\n</think>\nx", "no"]]
    try:
        assert scorer(prompts, completions, [[1]] * 2, {}).squeeze(1).tolist() == [1.0, 0.0]
    finally:
        scorer.close()


def test_max_completion_len_comes_from_the_run_unless_given(tiny_model_dir):
    from lit_grpo.train.module import GRPOModule

    module = GRPOModule(str(tiny_model_dir), [{"name": "soft_overlong_punishment", "args": {"soft_punish_cache": 2}}],
                        max_completion_length=6)
    assert module.scorer.rewards[0].keywords == {"soft_punish_cache": 2, "max_completion_len": 6}
    # lengths 3 (<= 6 - 2), 5 (inside the cache: (4 - 5) / 2), 7 (over)
    assert module.scorer(["p"] * 3, ["a", "b", "c"], [[1] * 3, [1] * 5, [1] * 7], {}).squeeze(1).tolist() == [0.0, -0.5, -1.0]
    given = GRPOModule(str(tiny_model_dir), [{"name": "soft_overlong_punishment", "args": {"soft_punish_cache": 2, "max_completion_len": 10}}],
                       max_completion_length=6)
    assert given.scorer.rewards[0].keywords["max_completion_len"] == 10
    module.scorer.close()
    given.scorer.close()


def test_rewards_command_lists_registered_plugins_only(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    plugins.get_reward("my_rewards.py:starts_with")
    main(["rewards"])
    out = capsys.readouterr().out
    assert "char_fraction" in out and "starts_with" not in out
