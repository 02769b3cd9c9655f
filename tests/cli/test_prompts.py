"""Prompts as users write them: ``data.prompt_template``, ``data.system_prompt``,
``data.conversational`` and ``data.chat_template_kwargs``, rendered with a tiny Qwen2.5-style model's
chat template exactly as the model sees them (in training, in validation and in ``lit-grpo prompts``)
and handed to the rewards as the conversation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import GSM8K_ROWS

import lit_grpo.rollout.collector
from lit_grpo.cli import main, run_cli
from lit_grpo.data import GRPODataModule, PromptFormat

REPO = Path(__file__).resolve().parents[2]
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
# Qwen3's switch: with enable_thinking false the assistant turn starts with an empty think block
THINKING_SWITCH = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"


pytestmark = pytest.mark.usefixtures("fresh_cli")  # tests/conftest.py


@pytest.fixture(scope="module")
def qwen3_style_dir(tiny_qwen2_dir, tmp_path_factory):
    """The tiny Qwen2 model whose chat template honours ``enable_thinking`` as Qwen3's does."""
    path = tmp_path_factory.mktemp("qwen3-style") / "model"
    shutil.copytree(tiny_qwen2_dir, path)
    template = path / "chat_template.jinja"
    template.write_text(template.read_text() + THINKING_SWITCH)
    return path


@pytest.fixture
def rows_file(write_jsonl):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "topic": "sums"} for i in range(4)]
    return write_jsonl(rows, name="questions.jsonl")


def test_prompt_format_builds_each_kind_of_prompt():
    row = {"prompt": "Say a:", "question": "2 + 2?", "topic": "sums"}
    assert PromptFormat()(row) == "Say a:"  # raw text, as TRL
    assert PromptFormat(conversational=True)(row) == [{"role": "user", "content": "Say a:"}]
    assert PromptFormat(prompt_template="{topic}: {question} {{x}}")(row) == "sums: 2 + 2? {x}"
    assert PromptFormat(prompt_template="Q: {question}", system_prompt="Be brief.")(row) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 2 + 2?"},
    ]
    chat = {"prompt": [{"role": "user", "content": "Hi"}]}
    assert PromptFormat(system_prompt="S")(chat) == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    own = {"prompt": [{"role": "system", "content": "Mine"}, {"role": "user", "content": "Hi"}]}
    assert PromptFormat(system_prompt="S")(own) == own["prompt"]  # a conversation keeps its own system message


def test_template_errors_name_the_setting_and_the_column(rows_file):
    data = GRPODataModule(path="json", data_files=str(rows_file), prompt_template="Solve: {questoin}")
    with pytest.raises(ValueError, match=r"data.prompt_template names column 'questoin', which the dataset .* does not have; "
                       r"its columns are \['question', 'answer', 'topic'\]"):
        data.setup("fit")
    with pytest.raises(ValueError, match=r"data.prompt_template .* is not a valid template"):
        GRPODataModule(path="json", data_files=str(rows_file), prompt_template="Solve: {question")
    with pytest.raises(ValueError, match=r"field \{0\} must be a plain column name"):
        GRPODataModule(path="json", data_files=str(rows_file), prompt_template="Solve: {0}")


def fit_config(tmp_path, model_dir, data_file, data: dict, **model) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": 1, "accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                    "default_root_dir": str(tmp_path),  # where LightningCLI saves config.yaml
                    "enable_progress_bar": False, "num_sanity_val_steps": 0},
        "model": {"model_name_or_path": str(model_dir), "num_generations": 2, "max_completion_length": 4,
                  "log_completions_every_n_steps": 0, "rewards": [{"name": "record"}], **model},
        "data": {"path": "json", "data_files": str(data_file), "batch_size": 2, "shuffle": False, **data},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_training_validation_and_rewards_see_the_rendered_prompts(tmp_path, qwen3_style_dir, rows_file, reward_plugin, monkeypatch):
    seen_by_reward = []
    reward_plugin(record=lambda prompts, completions, **kw: (seen_by_reward.extend(prompts), [0.0] * len(prompts))[1])
    texts_sampled = []
    render = lit_grpo.rollout.collector.render_prompts  # the texts that are tokenized and sampled from
    monkeypatch.setattr(lit_grpo.rollout.collector, "render_prompts",
                        lambda *a, **k: (texts := render(*a, **k), texts_sampled.extend(texts))[0])
    data = {"prompt_template": "Solve: {question}\nAnswer in <answer></answer> tags.", "system_prompt": "You add numbers.",
            "chat_template_kwargs": {"enable_thinking": False}, "val_split": "train[2:4]"}
    cli = run_cli(["--config", str(fit_config(tmp_path, qwen3_style_dir, rows_file, data))], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.validate(cli.model, datamodule=cli.datamodule)

    def rendered(i: int) -> str:
        return (
            "<|im_start|>system\nYou add numbers.<|im_end|>\n"
            f"<|im_start|>user\nSolve: What is {i} + {i}?\nAnswer in <answer></answer> tags.<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )

    assert texts_sampled == [rendered(0), rendered(1), rendered(2), rendered(3)]  # training batch, then validation
    assert seen_by_reward[0] == [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "Solve: What is 0 + 0?\nAnswer in <answer></answer> tags."},
    ]
    assert len(seen_by_reward) == 8  # 2 prompts x 2 completions, in training and in validation


def test_plain_prompts_stay_raw_text_unless_conversational(tmp_path, tiny_qwen2_dir, rows_file, capsys):
    base = ["prompts", "--config", str(fit_config(tmp_path, tiny_qwen2_dir, rows_file, {"prompt_column": "question"})), "-n", "1"]
    main(base)
    assert capsys.readouterr().out.splitlines()[1:] == ["What is 0 + 0?"]
    main([*base, "--data.conversational", "true"])
    out = capsys.readouterr().out
    assert out.split("\n", 1)[1] == QWEN_SYSTEM + "<|im_start|>user\nWhat is 0 + 0?<|im_end|>\n<|im_start|>assistant\n\n"


def test_prompts_command_shows_truncation_and_special_tokens(tmp_path, tiny_qwen2_dir, rows_file, capsys):
    config = fit_config(tmp_path, tiny_qwen2_dir, rows_file, {"prompt_column": "question", "conversational": True},
                        max_prompt_length=20)
    main(["prompts", "--config", str(config), "-n", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "----- train row 0: 20 tokens, the last 20 of 111 kept (model.max_prompt_length) -----"
    assert lines[1] == " 0 + 0?<|im_end|>" and lines[2] == "<|im_start|>assistant"  # the last 20 tokens


def test_prompts_command_shows_the_tools_schemas_and_refuses_a_misspelt_tool(tmp_path, tiny_qwen2_dir, rows_file, capsys):
    """With model.tools the model sees their schemas (the chat template's tools= argument): so does
    `lit-grpo prompts`; a tool that does not exist fails there, naming it, as it would in `fit`."""
    tests = str(Path(__file__).resolve().parents[1])
    config = fit_config(tmp_path, tiny_qwen2_dir, rows_file, {"prompt_column": "question", "conversational": True},
                        tools=[f"{tests}/scripted_policy.py:add"])
    main(["prompts", "--config", str(config), "-n", "1"])
    out = capsys.readouterr().out.split("\n", 1)[1]
    assert '<tools>\n{"type": "function", "function": {"name": "add", "description": "Add two integers."' in out
    assert out.endswith("<|im_start|>user\nWhat is 0 + 0?<|im_end|>\n<|im_start|>assistant\n\n")
    misspelt = fit_config(tmp_path, tiny_qwen2_dir, rows_file, {"prompt_column": "question", "conversational": True},
                          tools=[f"{tests}/scripted_policy.py:ad"])
    with pytest.raises(SystemExit) as exit_info:
        main(["prompts", "--config", str(misspelt), "-n", "1"])
    assert exit_info.value.code == 2
    assert "model.tools[0]" in capsys.readouterr().err


def test_prompts_command_shows_an_environments_tools(tmp_path, tiny_qwen2_dir, write_jsonl, capsys):
    pytest.importorskip("lit_grpo_kv_lookup", reason="pip install -e examples/environment-plugin (README: Tests)")
    rows = write_jsonl([{"prompt": "Which digit is stored under a?", "store": '{"a": "1"}', "key": "a"}] * 2, name="kv.jsonl")
    config = fit_config(tmp_path, tiny_qwen2_dir, rows, {"conversational": True}, environment={"name": "kv_lookup"})
    main(["prompts", "--config", str(config), "-n", "1"])
    assert '"name": "lookup", "description": "Look up the value stored under a key."' in capsys.readouterr().out


def test_chat_prompts_without_a_chat_template_are_refused_naming_the_setting(tmp_path, tiny_model_dir, rows_file, reward_plugin):
    reward_plugin(record=lambda prompts, **kw: [0.0] * len(prompts))
    no_template = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    cli = run_cli(["--config", str(fit_config(tmp_path, no_template, rows_file, {"prompt_column": "question", "conversational": True}))], run=False)
    with pytest.raises(ValueError, match=r"data.conversational or data.system_prompt\) but the tokenizer of "
                       r"model.model_name_or_path .* has no chat template"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


@pytest.mark.parametrize("recipe", ["qwen2.5-0.5b-gsm8k.yaml", "qwen2.5-7b-gsm8k-fsdp.yaml"])
def test_gsm8k_recipe_prompt_asks_for_the_format_its_rewards_score(tmp_path, tiny_qwen2_dir, gsm8k_file, capsys, recipe):
    data = gsm8k_file()
    main(["prompts", "--config", str(REPO / "configs" / recipe), "--model.model_name_or_path", str(tiny_qwen2_dir),
          "--data.path", "json", "--data.data_files", str(data), "--data.name", "null", "-n", "1",
          "--model.max_prompt_length", "2048"])  # the tiny tokenizer takes a token per character
    text = capsys.readouterr().out.split("\n", 1)[1]
    assert text.startswith("<|im_start|>system\nA conversation between User and Assistant.")
    assert "<think> </think> and <answer> </answer> tags" in text
    assert f"<|im_start|>user\n{GSM8K_ROWS[0]['question']}<|im_end|>\n<|im_start|>assistant\n" in text


def test_completions_table_shows_the_system_prompt():
    from lit_grpo.run.completions import as_text

    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    assert as_text(conversation) == "system: Be brief.\nuser: 2 + 2?"
    assert as_text([{"role": "assistant", "content": "4"}]) == "4"


def test_prompt_truncation_is_counted_and_warned_once(tiny_model_dir, say_a_or_b_file, fast_trainer):
    """``prompts/truncated_frac``: the fraction of prompts ``max_prompt_length`` cut; the first step
    that cuts one warns, once."""
    import warnings

    from test_module import MetricRecorder, make_data, make_module

    def run(**settings):
        recorder = MetricRecorder()
        module = make_module(tiny_model_dir, **settings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fast_trainer(max_steps=2, callbacks=[recorder]).fit(module, make_data(say_a_or_b_file))
        said = [w for w in caught if "model.max_prompt_length=4 cut" in str(w.message)]
        return [step["prompts/truncated_frac"] for step in recorder.steps], said

    fractions, said = run(max_prompt_length=4)  # "Say a:" has 6 tokens
    assert fractions == [1.0, 1.0] and len(said) == 1
    assert "cut 100% of this step's prompts" in str(said[0].message)
    fractions, said = run(max_prompt_length=6)
    assert fractions == [0.0, 0.0] and said == []
