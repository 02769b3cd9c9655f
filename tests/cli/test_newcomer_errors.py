"""A newcomer's mistakes (issue 51): each ends `lit-grpo fit` with exit status 2 and one line
`error: ...` that names the culprit (the file and byte, the path, the key and where its value came
from, the reward) and the fix; those about settings and rewards fire before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_errors import quickstart_writer

from lit_grpo.cli import main

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("fresh_cli", "no_model")  # fresh_cli: tests/conftest.py


@pytest.fixture
def no_model(monkeypatch):
    """Every error here comes before a model is loaded: loading one fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the mistake was found")

    monkeypatch.setattr("lit_grpo.models.build_policy", refuse)


@pytest.fixture
def config(tmp_path, tiny_model_dir, monkeypatch):
    """``config(**sections) -> path``: the quickstart with the tiny model, sections updated, in a
    working directory of its own (``tmp_path``)."""
    monkeypatch.chdir(tmp_path)
    return quickstart_writer(tmp_path, tiny_model_dir)


def error_line(capsys, *args: str) -> str:
    """``lit-grpo ARGS`` in this process: exit status 2, a few lines of stderr at most, the last the
    one ``error:`` line (no traceback, no usage dump); its text."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and sum(line.startswith("error:") for line in lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    assert len(lines) <= 6, err  # Lightning's "GPU available" lines, datasets' progress, the error
    return lines[-1].removeprefix("error: ")


# --------------------------------------------------------------------------------------------------
# 51.1, 51.2, 51.6: data files
# --------------------------------------------------------------------------------------------------

ROWS = [{"prompt": "Say é:", "target": "é"}] * 8


def test_a_data_file_that_is_not_utf8_names_the_file_byte_offset_and_encoding(config, tmp_path, capsys):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in ROWS).encode("latin-1"))
    message = error_line(capsys, "fit", "--config", str(config(data={"data_files": str(latin)})))
    # '{"prompt": "Say ' is 16 bytes: the 17th, 0xe9 (Latin-1's é), is the first that is not UTF-8
    assert message.startswith(f"data file '{latin}' is not UTF-8: byte 0xe9 at byte offset 16 (line 1)")
    assert f"re-encode it to UTF-8 (for a Latin-1 / Windows-1252 file: iconv -f cp1252 -t utf-8 {latin} > latin.utf8.jsonl)" in message

    as_csv = tmp_path / "latin.csv"
    as_csv.write_bytes(("prompt,target\n" + "Say é:,é\n" * 8).encode("latin-1"))
    message = error_line(capsys, "fit", "--config", str(config(data={"path": str(as_csv), "data_files": None})))
    assert message.startswith(f"data file '{as_csv}' is not UTF-8: byte 0xe9 at byte offset 18 (line 2)")


def test_a_csv_file_the_reader_cannot_read_says_why(config, tmp_path, capsys):
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("prompt,target\nSay a:,a\nSay b:,b,extra,more\n")
    message = error_line(capsys, "fit", "--config", str(config(data={"path": str(ragged), "data_files": None})))
    assert message == (  # not datasets' "An error occurred while generating the dataset"
        f"could not load the dataset path='{ragged}' (split='train'): ParserError: Error tokenizing data. C error: "
        "Expected 2 fields in line 3, saw 4"
    )


def test_a_compressed_data_file_is_not_taken_for_one_that_is_not_utf8(tmp_path):
    import gzip

    from lit_grpo.data import GRPODataModule

    packed = tmp_path / "prompts.jsonl.gz"
    packed.write_bytes(gzip.compress("".join(json.dumps(row) + "\n" for row in ROWS).encode()))
    data = GRPODataModule(path="json", data_files=str(packed), batch_size=2)
    data.setup("fit")
    assert data.train_dataset["target"] == ["é"] * 8


def test_a_data_path_that_does_not_exist_says_so(config, tmp_path, capsys, monkeypatch):
    message = error_line(capsys, "fit", "--config", str(config(data={"path": "./some_dir", "data_files": None})))
    assert message.startswith(f"data.path './some_dir': no such file or directory (looked for in {tmp_path}); ")
    assert "a Hugging Face Hub id (owner/name)" in message
    # a name that could be a Hub id: not a local path, and the Hub is off
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    message = error_line(capsys, "fit", "--config", str(config(data={"path": "some/dir", "data_files": None})))
    assert message.endswith(
        "; no local path 'some/dir' exists and the Hugging Face Hub is not reachable offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set)"
    )


def test_a_data_file_of_blank_lines_says_it_has_no_rows(config, tmp_path, capsys):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n  \n")
    message = error_line(capsys, "fit", "--config", str(config(data={"data_files": str(blank)})))
    assert message.startswith(f"data file '{blank}' of the dataset path='json'")
    assert "holds only blank lines: no rows to train on (a JSON Lines file holds one JSON object per line" in message


# --------------------------------------------------------------------------------------------------
# 51.3: optimizer arguments, and where each value came from
# --------------------------------------------------------------------------------------------------


def test_a_negative_learning_rate_is_refused_before_the_model_loads_naming_where_it_was_given(config, tmp_path, capsys):
    base = str(config())
    optimizer = tmp_path / "optimizer.yaml"
    optimizer.write_text("optimizer:\n  class_path: torch.optim.AdamW\n  init_args:\n    lr: -3.0e-3\n")
    refused = "torch.optim.AdamW refuses it: Invalid learning rate: -0.003; a learning rate is a number >= 0, such as 3e-3"
    assert error_line(capsys, "fit", "--config", base, "--config", str(optimizer)) == (
        f"optimizer.init_args.lr = -0.003 ({optimizer}:4): {refused}"
    )
    assert error_line(capsys, "fit", "--config", base, "--optimizer.init_args.lr=-3e-3") == (
        f"optimizer.init_args.lr = -0.003 (command line): {refused}"
    )


def test_a_learning_rate_that_is_no_number_on_the_command_line_is_blamed_on_the_command_line(config, tmp_path, capsys):
    base = str(config())  # its optimizer block sets lr at a line of its own
    assert error_line(capsys, "fit", "--config", base, "--optimizer.init_args.lr", "3e-3x") == (
        "expected a float, got '3e-3x' (optimizer.init_args.lr, command line)"
    )


def test_a_negative_number_after_a_space_says_to_write_key_equals_value(config, capsys):
    assert error_line(capsys, "fit", "--config", str(config()), "--optimizer.init_args.lr", "-3e-3") == (
        "--optimizer.init_args.lr -3e-3: the value -3e-3 reads as an option; write --optimizer.init_args.lr=-3e-3 "
        "(command line; a negative number needs the =)"
    )


# --------------------------------------------------------------------------------------------------
# 51.4: a reward function of one's own, named as TRL users would
# --------------------------------------------------------------------------------------------------

REWARD_LEN = "def reward_len_51(completions, **kwargs):\n    return [-abs(20 - len(c)) for c in completions]\n"


def test_a_reward_named_like_a_function_of_a_file_in_the_working_directory_says_file_py_function(config, tmp_path, capsys):
    (tmp_path / "rewards_51.py").write_text(REWARD_LEN)
    path = config(model={"rewards": [{"name": "reward_len_51"}]})
    assert error_line(capsys, "fit", "--config", str(path)) == (
        "Unknown reward 'reward_len_51': rewards_51.py in the working directory defines reward_len_51; name it "
        "'rewards_51.py:reward_len_51' (a function of your own is named 'path/to/file.py:function'; an installed "
        "reward by its name alone)"
    )


def test_a_reward_named_by_module_whose_file_is_in_the_working_directory_says_file_py_function(
    config, tmp_path, capsys, monkeypatch
):
    (tmp_path / "rewards_51b.py").write_text(REWARD_LEN)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".", str(tmp_path))])
    path = config(model={"rewards": [{"name": "rewards_51b:reward_len_51"}]})
    assert error_line(capsys, "fit", "--config", str(path)) == (
        "reward 'rewards_51b:reward_len_51': cannot import module 'rewards_51b' (No module named 'rewards_51b'); "
        "rewards_51b.py is in the working directory, which is not where modules are imported from (installed "
        "packages, PYTHONPATH): name it 'rewards_51b.py:reward_len_51'"
    )


def test_a_reward_file_name_near_a_file_that_exists_says_did_you_mean(config, tmp_path, capsys):
    (tmp_path / "rewards_51c.py").write_text(REWARD_LEN)
    path = config(model={"rewards": [{"name": "reward_51c.py:reward_len_51"}]})
    assert error_line(capsys, "fit", "--config", str(path)) == (
        f"reward 'reward_51c.py:reward_len_51': no file 'reward_51c.py' (looked for {tmp_path}/reward_51c.py); "
        "did you mean 'rewards_51c.py'?"
    )


# --------------------------------------------------------------------------------------------------
# 51.5: a reward function without **kwargs
# --------------------------------------------------------------------------------------------------


def test_a_reward_function_without_kwargs_is_refused_at_start_saying_to_add_kwargs(config, tmp_path, capsys):
    (tmp_path / "strict_51.py").write_text("def reward_len(completions):\n    return [-abs(20 - len(c)) for c in completions]\n")
    path = config(model={"rewards": [{"name": "char_fraction"}, {"name": "strict_51.py:reward_len"}]})
    assert error_line(capsys, "fit", "--config", str(path)) == (
        f"Reward 'strict_51.py:reward_len' ({tmp_path}/strict_51.py) cannot take the keyword argument "
        "'prompts': every call passes prompts, completions, completion_ids and each column of the data (target) as "
        "keyword arguments, and its signature is (completions); add **kwargs: def reward_len(completions, **kwargs) "
        "(model.rewards[1])"
    )


# --------------------------------------------------------------------------------------------------
# 51.7: a key written twice in one YAML mapping
# --------------------------------------------------------------------------------------------------


def test_a_key_written_twice_in_one_mapping_names_both_lines(config, tmp_path, capsys):
    base = str(config())
    twice = tmp_path / "twice.yaml"
    twice.write_text("model:\n  beta: 0.0\n  rewards:\n    - name: char_fraction\n      weight: 1.0\n      weight: 2.0\n"
                     "  beta: 0.04\n")
    assert error_line(capsys, "fit", "--config", base, "--config", str(twice)) == (
        f"key model.beta is written twice in one mapping, at lines 2 and 7 ({twice}:2 and {twice}:7); "
        "YAML would keep the second silently: remove one of them"
    )
    twice.write_text("model:\n  rewards:\n    - name: char_fraction\n      weight: 1.0\n      weight: 2.0\n")
    assert error_line(capsys, "fit", "--config", base, "--config", str(twice)).startswith(
        "key model.rewards[0].weight is written twice in one mapping, at lines 4 and 5"
    )
