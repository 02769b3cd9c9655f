"""Completions you can read: completions.jsonl in the run's log directory and `lit-grpo completions`."""

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from test_module import LOWERCASE, make_data, make_module

from lit_grpo.cli import main


@pytest.fixture
def logged_run(tiny_model_dir, say_a_or_b_file, fast_trainer, tmp_path, capsys):
    """A 3-step fit logging every 2 steps and printing 2 rows; returns (log_dir, scored per step)."""
    pl.seed_everything(0)
    module = make_module(tiny_model_dir, rewards=LOWERCASE, print_completions=2)
    scored_steps = []
    generate_and_score = module.generate_and_score

    def recording(batch, training=True):
        scored, completions = generate_and_score(batch, training)
        scored_steps.append((batch, scored, completions))
        return scored, completions

    module.generate_and_score = recording
    logger = TensorBoardLogger(tmp_path / "runs", name="demo")
    trainer = fast_trainer(max_steps=3, logger=logger, log_every_n_steps=2)
    trainer.fit(module, make_data(say_a_or_b_file))
    return logger.log_dir, scored_steps, capsys.readouterr().out


def test_logged_steps_are_written_with_rewards_and_advantages(logged_run):
    log_dir, scored_steps, console = logged_run
    lines = (Path(log_dir) / "completions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    # steps 0 and 2 of 0, 1, 2 are logging steps (every 2); 2 prompts x 4 completions each
    assert [r["step"] for r in records] == [0] * 8 + [2] * 8
    for step, (batch, scored, completions) in [(0, scored_steps[0]), (2, scored_steps[2])]:
        rows = [r for r in records if r["step"] == step]
        assert [r["prompt"] for r in rows] == [p for p in batch.prompts for _ in range(4)]
        assert [r["completion"] for r in rows] == completions
        assert [r["rewards"]["char_fraction"] for r in rows] == pytest.approx(scored.rewards_per_func[:, 0].tolist())
        assert [r["reward"] for r in rows] == pytest.approx(scored.rewards.tolist())
        assert [r["advantage"] for r in rows] == pytest.approx(scored.group.advantages.tolist())
    # print_completions: 2 rows of each logged step on the console
    assert console.count("completions at step") == 2
    assert "| prompt | completion | char_fraction | reward | advantage |" in console


def test_completions_command_shows_a_step(logged_run, capsys):
    log_dir, scored_steps, _ = logged_run
    run_dir = str(Path(log_dir).parent)  # runs/demo: the newest file below it
    main(["completions", run_dir, "--step", "0", "--limit", "3"])
    out = capsys.readouterr().out
    assert "step 0 (3 of 8 completions)" in out
    assert out.count("\n| ") == 3 + 1  # header and 3 rows (the separator starts with "|-")
    first_reward = float(scored_steps[0][1].rewards[0])
    assert f"{first_reward:.3f}" in out.splitlines()[3]

    main(["completions", run_dir, "--json", "--limit", "1"])  # the last logged step by default
    record = json.loads(capsys.readouterr().out)
    assert record["step"] == 2


def test_completions_command_errors_name_what_is_missing(logged_run, tmp_path, capsys):
    log_dir, _, _ = logged_run
    with pytest.raises(SystemExit) as exit_info:
        main(["completions", log_dir, "--step", "7"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: step 7 was not logged; logged steps: 0, 2" in err
    with pytest.raises(SystemExit):
        main(["completions", str(tmp_path / "empty")])
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["completions", str(tmp_path / "empty")])
    assert "no completions.jsonl under" in capsys.readouterr().err


def fit_with_logger(module, logger, data, fast_trainer, steps=2):
    trainer = fast_trainer(max_steps=steps, logger=logger, log_every_n_steps=1)
    trainer.fit(module, data)
    return trainer


def test_a_logger_without_a_directory_gets_completions_under_default_root_dir(
    tiny_model_dir, say_a_or_b_file, fast_trainer, tmp_path, capsys, caplog
):
    """A metrics-only logger: the completions table has nowhere to go (said once), and
    completions.jsonl lands in ``<default_root_dir>/<name>/<version>``, the run's own directory."""
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.loggers.logger import rank_zero_experiment

    class MetricsOnly(Logger):
        name, version = "metrics-only", 7
        logged: list = []

        @property
        @rank_zero_experiment
        def experiment(self):
            return None

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.logged.append(metrics)

    logger = MetricsOnly()
    assert logger.log_dir is None
    module = make_module(tiny_model_dir, rewards=LOWERCASE, print_completions=1, log_completions_every_n_steps=1)
    with caplog.at_level("INFO"):
        fit_with_logger(module, logger, make_data(say_a_or_b_file), lambda **kw: fast_trainer(default_root_dir=tmp_path, **kw))
    assert module.run_log_dir == tmp_path / "metrics-only" / "7"
    records = [json.loads(line) for line in (module.run_log_dir / "completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == [0, 1]
    said = [r.message for r in caplog.records if "has no table or text form" in r.message]
    assert said == ["MetricsOnly has no table or text form for the completions table; completions.jsonl in the run's log directory holds them (model.save_completions)"]
    assert [m for m in logger.logged if "reward" in m] and capsys.readouterr().out.count("completions at step") == 2


def test_csv_logger_keeps_completions_jsonl_in_its_version_directory(tiny_model_dir, say_a_or_b_file, fast_trainer, tmp_path, caplog):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path / "csv", name="run")
    module = make_module(tiny_model_dir, rewards=LOWERCASE, log_completions_every_n_steps=1)
    with caplog.at_level("INFO"):
        fit_with_logger(module, logger, make_data(say_a_or_b_file), fast_trainer)
    assert module.run_log_dir == Path(logger.log_dir)
    assert len((Path(logger.log_dir) / "completions.jsonl").read_text().splitlines()) == 2 * 8
    assert "reward" in (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()[0]
    assert sum("CSVLogger has no table or text form" in r.message for r in caplog.records) == 1  # said once


def test_wandb_logger_gets_the_completions_table(tiny_model_dir, say_a_or_b_file, fast_trainer, tmp_path, monkeypatch):
    """An offline Weights & Biases run (no network) receives a ``completions`` table per step."""
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="lit-grpo-test")
    module = make_module(tiny_model_dir, rewards=LOWERCASE, log_completions_every_n_steps=1, num_completions_to_log=3)
    fit_with_logger(module, logger, make_data(say_a_or_b_file), fast_trainer)
    run_dir = Path(logger.experiment.dir).parent  # .../wandb/offline-run-<date>-<id>
    logger.experiment.finish()
    tables = sorted(run_dir.rglob("completions_*.table.json"))
    assert len(tables) == 2  # steps 0 and 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["prompt", "completion", "char_fraction", "reward", "advantage"]
    assert len(table["data"]) == 3 and table["data"][0][0] in ("Say a:", "Say b:")
    # completions.jsonl: in the run's own directory, <save_dir>/<project>/<run id>
    assert module.run_log_dir == tmp_path / "lit-grpo-test" / str(logger.version)
    assert (module.run_log_dir / "completions.jsonl").is_file()


def test_log_unique_prompts_keeps_the_first_completion_of_each_prompt_in_the_table(
    tiny_model_dir, write_jsonl, fast_trainer, tmp_path, monkeypatch
):
    """Two prompts repeated (a, b, a, b in a batch of 4, G = 2): with ``model.log_unique_prompts`` the logger's
    table shows the first completion of each prompt (TRL's), ``completions.jsonl`` keeps all 8 rows."""
    import lit_grpo.run.completions

    tables = []
    monkeypatch.setattr(lit_grpo.run.completions, "log_table", lambda logger, records, step: tables.append(records) or True)
    module = make_module(tiny_model_dir, rewards=LOWERCASE, num_generations=2, log_completions_every_n_steps=1,
                         num_completions_to_log=8, log_unique_prompts=True)
    logger = TensorBoardLogger(tmp_path / "runs", name="unique")
    data = make_data(write_jsonl([{"prompt": prompt} for prompt in ["Say a:", "Say b:"] * 2]), batch_size=4, shuffle=False)
    fit_with_logger(module, logger, data, fast_trainer, steps=1)
    records = [json.loads(line) for line in (Path(logger.log_dir) / "completions.jsonl").read_text().splitlines()]
    assert [record["prompt"] for record in records] == ["Say a:"] * 2 + ["Say b:"] * 2 + ["Say a:"] * 2 + ["Say b:"] * 2
    assert tables == [[records[0], records[2]]]


def test_unique_prompt_rows_compares_conversations_by_their_text():
    from lit_grpo.run.completions import unique_prompt_rows

    chat = [{"role": "user", "content": "hi"}]
    records = [{"prompt": list(chat), "completion": "1"}, {"prompt": "hi", "completion": "2"},
               {"prompt": [dict(chat[0])], "completion": "3"}, {"prompt": "hi", "completion": "4"}]
    assert [record["completion"] for record in unique_prompt_rows(records)] == ["1", "2"]
