"""Rewards as plain Python functions, as TRL users write them: ``path/to/file.py:function`` (beside
the config file or in the working directory) or ``package.module:function``, with ``weight`` and
``args`` as for registered rewards; and run settings a reward may take by name."""

from __future__ import annotations

import sys
import textwrap

import pytest
import yaml

from lit_grpo import plugins
from lit_grpo.cli import main, run_cli
from lit_grpo.plugins import UnknownRewardError
from lit_grpo.scoring import RewardScorer, build_reward
from lit_grpo.scoring.arguments import RewardArgumentError

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
        assert cli.model.scorer.names == [f"{recipe / 'my_rewards.py'}:starts_with"]
        assert cli.model.scorer.weights.tolist() == [0.5]
        assert cli.model.scorer.rewards[0].keywords == {"prefix": "b"}
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        assert f"rewards/{recipe / 'my_rewards.py'}:starts_with/mean" in cli.trainer.callback_metrics
    finally:
        cli.model.scorer.close()


def test_trl_reward_functions_work_by_name():
    pytest.importorskip("trl.rewards")
    value = scores("trl.rewards:think_format_reward", ["<think>\nhm\n</think>\nx", "no"])
    assert value == [1.0, 0.0]


def test_max_completion_len_comes_from_the_run_unless_given(tiny_model_dir):
    from lit_grpo.module import GRPOModule

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
