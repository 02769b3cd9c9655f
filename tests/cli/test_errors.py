"""Errors a person can read: a mistake in the input ends `lit-grpo` with one line `error: ...` on
stderr naming the key, file:line or reward, and exit status 2, without a traceback or a usage dump
(``LIT_GRPO_TRACEBACK=1`` shows the traceback); a bug still shows its traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from lit_grpo.cli import main

REPO = Path(__file__).resolve().parents[2]
LIT_GRPO = str(Path(sys.executable).with_name("lit-grpo"))


pytestmark = pytest.mark.usefixtures("fresh_cli")  # tests/conftest.py


def quickstart_writer(tmp_path: Path, tiny_model_dir: Path):
    """``write(name="config.yaml", **sections) -> path``: the quickstart with the tiny model, one step,
    no logger or checkpoints, its sections updated, written in ``tmp_path``."""

    def write(name="config.yaml", **sections):
        quickstart = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
        quickstart["model"]["model_name_or_path"] = str(tiny_model_dir)
        quickstart["data"]["data_files"] = str(REPO / quickstart["data"]["data_files"])
        quickstart["trainer"].update(max_steps=1, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
        for section, values in sections.items():
            quickstart.setdefault(section, {}).update(values)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(quickstart, sort_keys=False))
        return path

    return write


@pytest.fixture
def config(tmp_path, tiny_model_dir):
    """``config(**changes) -> path``: the quickstart with the tiny model, sections updated."""
    return quickstart_writer(tmp_path, tiny_model_dir)


def error_line(capsys, *args: str) -> str:
    """Run ``lit-grpo ARGS`` in this process: it must exit with status 2, its stderr ending with
    one ``error:`` line and holding no traceback or usage dump (progress bars may come before)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err and "Logging error" not in err, err
    return lines[-1].removeprefix("error: ")


def test_a_user_error_is_one_line_and_status_2_and_a_traceback_on_request(config, tmp_path):
    path = config(model={"num_generations": 1})
    run = lambda **env: subprocess.run(  # noqa: E731
        [LIT_GRPO, "fit", "--config", str(path)], capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )
    with ThreadPoolExecutor(2) as side_by_side:  # two processes at once: their imports take the time of one
        plain, shown = side_by_side.map(lambda env: run(**env), [{}, {"LIT_GRPO_TRACEBACK": "1"}])
    assert plain.returncode == 2
    assert plain.stderr.splitlines()[-1] == (
        "error: model.num_generations must be at least 2 (got 1): GRPO's advantage is a completion's reward "
        "relative to the other completions of its group"
    )
    assert "Traceback" not in plain.stderr and "usage:" not in plain.stderr
    assert shown.returncode != 0 and "Traceback (most recent call last)" in shown.stderr
    assert "lit_grpo.errors.ConfigError: model.num_generations must be at least 2" in shown.stderr


def test_an_internal_bug_still_shows_its_traceback(monkeypatch, capsys):
    def broken(argv):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(__import__("lit_grpo.cli", fromlist=["SUBCOMMANDS"]).SUBCOMMANDS, "rewards", broken)
    with pytest.raises(ZeroDivisionError):
        main(["rewards"])


def test_a_misspelt_key_in_yaml_names_the_file_line_and_the_closest_key(config, tmp_path, capsys):
    base = config()
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  max_steps: 2\nmodel:\n  beta: 0.0\n  num_generation: 4\n")
    assert error_line(capsys, "fit", "--config", str(base), "--config", str(typo)) == (
        f"unknown key model.num_generation; did you mean model.num_generations? ({typo}:5)"
    )


def test_a_mistake_inside_a_reward_entry_names_the_file_line_and_the_closest_key(config, tmp_path, capsys):
    base = str(config())
    entry = tmp_path / "entry.yaml"
    entry.write_text("model:\n  rewards:\n    - name: char_fraction\n      wieght: 2\n")
    assert error_line(capsys, "fit", "--config", base, "--config", str(entry)) == (
        f"unknown key model.rewards[0].wieght; did you mean weight? ({entry}:4)"
    )
    entry.write_text("model:\n  eval_rewards:\n    - {name: char_fraction}\n    - {name: think_format, on_eror: zero}\n")
    assert error_line(capsys, "fit", "--config", base, "--config", str(entry)) == (
        f"unknown key model.eval_rewards[1].on_eror; did you mean on_error? ({entry}:4)"
    )
    entry.write_text("model:\n  rewards:\n    - {name: char_fraction, weight: 1}\n    - {name: think_format, weight: heavy}\n")
    assert error_line(capsys, "fit", "--config", base, "--config", str(entry)) == (
        f"Expected a <class 'float'>. Got value: heavy (model.rewards[1].weight, {entry}:4)"
    )


def test_a_yaml_syntax_error_names_the_file_line_and_the_key_before_it(config, tmp_path, capsys):
    base = str(config())
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  beta: 0.0\n   num_generations: 4\n")
    assert error_line(capsys, "fit", "--config", base, "--config", str(broken)) == (
        f"invalid YAML: mapping values are not allowed here at column 19, after key model.beta ({broken}:3)"
    )
    broken.write_text("model:\n  rewards: [{name: char_fraction, weight: 2}\n  beta: 0.0\n")
    assert error_line(capsys, "fit", "--config", base, "--config", str(broken)) == (
        "invalid YAML: expected ',' or ']', but got '<scalar>' at column 3 (while parsing a flow sequence that starts at "
        f"line 2), after key model.rewards[0].weight ({broken}:3)"
    )


def test_a_column_a_reward_takes_is_checked_before_any_model_is_loaded(config, tmp_path, capsys, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def graded(completions, answer, **kwargs):\n    return [0.0] * len(completions)\n")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data's columns were checked")

    monkeypatch.setattr("lit_grpo.models.build_policy", no_model)
    path = config(model={"rewards": [{"name": "char_fraction"}, {"name": "my_rewards.py:graded"}]})
    assert error_line(capsys, "fit", "--config", str(path)) == (
        f"Reward '{tmp_path}/my_rewards.py:graded' ({tmp_path}/my_rewards.py) takes 'answer', a parameter without a "
        f"default, but the dataset path='json' (data_files='{REPO}/configs/data/quickstart.jsonl', split='train') has no "
        "column 'answer'; the columns it passes on to rewards and environments: target (model.rewards[1])"
    )


def test_a_misspelt_or_abbreviated_option_is_refused_with_the_closest_key(config, capsys):
    base = str(config())
    assert error_line(capsys, "fit", "--config", base, "--model.num_generation", "4") == (
        "unknown option --model.num_generation; did you mean --model.num_generations? "
        "(command line; options are never abbreviated)"
    )
    assert error_line(capsys, "fit", "--config", base, "--model.max_compl", "4").startswith(
        "unknown option --model.max_compl; did you mean --model.max_completion_length?"
    )
    assert error_line(capsys, "fit", "--config", base, "--model.num_generations", "x") == (
        "Expected a <class 'int'>. Got value: x (model.num_generations)"
    )


def test_a_malformed_json_row_names_the_file_and_line(config, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Say a:", "target": "a"}\n{"prompt": "Say b:" "target": "b"}\n')
    path = config(data={"data_files": str(rows), "batch_size": 1})
    assert error_line(capsys, "fit", "--config", str(path)) == (
        f"line 2 is not valid JSON: Expecting ',' delimiter at column 21 ({rows}:2)"
    )
    rows.write_text('{"prompt": "Say a:"}\n["Say b:"]\n')
    assert error_line(capsys, "fit", "--config", str(path)) == f"line 2 is a JSON list, not an object of columns ({rows}:2)"


def test_a_model_directory_without_a_model_says_what_is_missing(config, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert error_line(capsys, "fit", "--config", str(config(model={"model_name_or_path": str(empty)}))) == (
        f"model.model_name_or_path '{empty}' is a directory without a model: no config.json (it holds nothing); "
        "a save_pretrained directory has config.json, the weights and the tokenizer files"
    )


def test_a_key_the_model_class_does_not_take_in_model_init_kwargs_is_one_line_naming_it(config, tiny_model_dir, capsys):
    """transformers hands unknown from_pretrained keys to the model's __init__ (a TypeError); the line names
    the key and model.model_init_kwargs, and not the token beside it."""
    message = error_line(capsys, "fit", "--config", str(config(model={"model_init_kwargs": {"token": "hf_planted123", "bogus": 1}})))
    assert message.startswith(f"model.model_init_kwargs has 'bogus', which the model class of '{tiny_model_dir}' does not take ("), message
    assert "remove it" in message and "hf_planted123" not in message


def test_a_peft_adapter_directory_says_how_to_train_from_it(config, tmp_path, tiny_model_dir, capsys):
    """``lit-grpo export --no-merge-lora`` writes an adapter; training from it says to merge it with
    ``lit-grpo export ADAPTER DIR``, which works, and training from DIR then works."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, target_modules="all-linear"))
    model.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(adapter)
    message = error_line(capsys, "fit", "--config", str(config(model={"model_name_or_path": str(adapter)})))
    assert message == (
        f"model.model_name_or_path '{adapter}' is a peft adapter (adapter_config.json, no config.json), not a model: "
        f"merge it into its base model with `lit-grpo export {adapter} MERGED_DIR` and train from MERGED_DIR "
        "(model.lora trains a new adapter on it)"
    )
    merged = tmp_path / "merged"
    main(["export", str(adapter), str(merged)])
    assert (merged / "config.json").is_file() and "Exported" in capsys.readouterr().out
    main(["fit", "--config", str(config(model={"model_name_or_path": str(merged)}))])


def test_a_misspelt_reward_argument_is_an_error_with_the_closest_name(config, capsys):
    path = config(model={"rewards": [{"name": "char_fraction", "args": {"char": "a"}}]})
    assert error_line(capsys, "fit", "--config", str(path)) == (
        "Reward 'char_fraction' (lit-grpo-rewards 0.1.0) got an unexpected argument 'char' in args "
        "(did you mean 'chars'?); its function accepts: target, chars (model.rewards[0].args)"
    )


def test_export_of_a_file_that_is_not_a_checkpoint_says_so(config, tmp_path, capsys):
    yaml_file = config()
    message = error_line(capsys, "export", str(yaml_file), str(tmp_path / "out"))
    assert message.startswith(f"'{yaml_file}' is not a checkpoint: torch.load failed (ValueError: not a zip archive, as torch.save writes)")
    assert message.endswith("export takes a .ckpt file written by lit-grpo fit, its sharded checkpoint directory, or a peft adapter directory")
    assert error_line(capsys, "export") == (
        "the following arguments are required: ckpt, dir (lit-grpo export; `lit-grpo export --help` describes it)"
    )


def test_help_lists_the_commands_that_exist_and_test_predict_are_not_offered(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    commands = [line.split()[0] for line in out.split("commands:")[1].split("\n\n")[0].strip().splitlines()]
    assert commands == ["fit", "validate", "rewards", "environments", "prompts", "completions", "export", "init-tiny", "serve"]
    for command in ("test", "predict"):
        assert error_line(capsys, command).startswith(f"argument subcommand: invalid choice: '{command}' (choose from 'fit', 'validate')")


def test_the_progress_bar_counts_optimizer_steps_and_shows_the_reward(config, capsys):
    path = config(trainer={"max_steps": 3, "enable_progress_bar": True}, model={"num_iterations": 1})
    main(["fit", "--config", str(path)])
    bar = capsys.readouterr().out.split("\r")
    final = [line for line in bar if line.startswith("steps")][-1]
    assert "3/3" in final and "reward=" in final
    assert "Epoch" not in "".join(bar) and "v_num" not in "".join(bar)


def test_completions_of_a_missing_step_says_which_steps_exist(tmp_path, capsys):
    log = tmp_path / "completions.jsonl"
    log.write_text("".join(json.dumps({"step": s, "prompt": "p", "completion": "c", "rewards": {}, "reward": 0.0, "advantage": 0.0}) + "\n" for s in (0, 2)))
    assert error_line(capsys, "completions", str(log), "--step", "1") == f"step 1 was not logged; logged steps: 0, 2 ({log})"
    shutil.rmtree(tmp_path)
    assert error_line(capsys, "completions", str(tmp_path)) == f"{tmp_path} does not exist"


# Lightning's messages on every run that a user can do nothing about (lit_grpo.run.callbacks.EXPECTED_LIGHTNING_WARNINGS)
UNACTIONABLE = ["isinstance(treespec, LeafSpec)", "💡 Tip", "seamless cloud", "LightningCLI's args parameter",
                "all_gather is deprecated", "Using ModelCheckpoint with manual optimization"]


def test_a_real_run_prints_no_unactionable_warnings_and_its_error_starts_a_fresh_line(config, tmp_path):
    """``lit-grpo fit`` as a user runs it, the progress bar showing, a reward that fails at the third
    step: Lightning's noise is gone, a warning the user can act on stays, and the error starts its own line."""
    (tmp_path / "flaky.py").write_text(
        "calls = 0\n\n\ndef grader(completions, **kwargs):\n    global calls\n    calls += 1\n"
        "    if calls == 3:\n        raise ConnectionError('the grader is down')\n    return [0.0] * len(completions)\n"
    )
    path = config(
        trainer={"max_steps": 5, "enable_progress_bar": True, "enable_checkpointing": True},
        model={"rewards": [{"name": f"{tmp_path}/flaky.py:grader"}], "validate_before_training": True},
    )
    # the bar (on stdout) and the messages (on stderr) in one stream, as a terminal shows them
    run = subprocess.run([LIT_GRPO, "fit", "--config", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    shown = run.stdout
    assert run.returncode == 2, shown[-3000:]
    assert [noise for noise in UNACTIONABLE if noise in shown] == [], shown
    actionable = "UserWarning: model.validate_before_training is set but there is no validation data (data.val_split)"
    (warning_line,) = [line for line in shown.split("\n") if actionable in line]  # shown, and not on a bar's line
    assert "%|" not in warning_line and "\r" not in warning_line, warning_line
    before, error = shown.split("error: ", 1)
    assert "steps:  40%" in before and "2/5" in before  # the bar was showing
    assert before.endswith("\n"), before[-200:]  # not at the end of the bar's line
    assert error.startswith(f"Reward '{tmp_path}/flaky.py:grader' ({tmp_path}/flaky.py) raised ConnectionError: the grader is down")


def test_prompts_prints_no_warning_about_its_own_arguments(config):
    run = subprocess.run([LIT_GRPO, "prompts", "--config", str(config()), "-n", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "----- train row 0" in run.stdout
    assert [noise for noise in UNACTIONABLE if noise in run.stderr] == [], run.stderr


PLANTED = "PLANTEDsecret7182"  # in settings that fail: the error line names the setting, never the secret


@pytest.mark.parametrize("section, key, value, culprit", [
    ("model", "model_name_or_path", f"https://user:{PLANTED}@host/model", "model.model_name_or_path"),
    ("data", "path", f"https://{PLANTED}@host/data", "data.path"),
    ("data", "path", f"https://host/data.jsonl?api_key={PLANTED}", "data.path"),
])
def test_an_error_that_quotes_a_setting_holds_no_secret(config, capsys, section, key, value, culprit):
    line = error_line(capsys, "fit", "--config", str(config(**{section: {key: value}})))
    assert line.startswith(culprit) and "<redacted>" in line, line
    assert PLANTED not in line


def test_the_command_that_resumes_a_stopped_run_shows_no_secret_of_its_command_line():
    from lit_grpo.cli import resume_command

    shown = resume_command(["fit", "--config", "run.yaml", "--model.model_init_kwargs.token", f"hf_{PLANTED}",
                            f"--model.model_init_kwargs.token=hf_{PLANTED}", f"--model.vllm_server_urls=[http://u:{PLANTED}@h:8000]",
                            "--ckpt_path", "old.ckpt", "--trainer.max_steps", "5"])
    assert PLANTED not in shown
    assert shown == ("lit-grpo fit --config run.yaml --model.model_init_kwargs.token '<redacted>' "
                     "'--model.model_init_kwargs.token=<redacted>' '--model.vllm_server_urls=[http://u:<redacted>@h:8000]' "
                     "--trainer.max_steps 5 --ckpt_path last")
