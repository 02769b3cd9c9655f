"""What a newcomer's failed tries leave behind, and what a run shows while it goes (issue 51): a run
that fails before its first step leaves no run directory that ``--ckpt_path last`` would trip on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lit_grpo.cli import main

REPO = Path(__file__).resolve().parents[1]
TENSORBOARD = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "runs", "name": "t"}}

pytestmark = pytest.mark.usefixtures("fresh_cli")  # tests/conftest.py


@pytest.fixture
def fit(tmp_path, tiny_model_dir, monkeypatch):
    """``fit(*args, **model)``: ``lit-grpo fit`` in this process, in ``tmp_path``, on a small quickstart."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str, **model) -> None:
        config = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
        config["trainer"].update(logger=TENSORBOARD, enable_progress_bar=False, enable_model_summary=False)
        config["model"].update(model_name_or_path=str(tiny_model_dir), num_generations=2, max_completion_length=4, **model)
        config["data"].update(data_files=str(REPO / config["data"]["data_files"]), batch_size=2)
        Path("config.yaml").write_text(yaml.safe_dump(config))
        main(["fit", "--config", "config.yaml", *args])

    return run


def test_a_run_that_fails_before_its_first_step_leaves_no_run_behind_and_last_resumes_the_real_one(fit, tmp_path, capsys):
    fit("--trainer.max_steps=2")
    real = tmp_path / "runs/t/version_0"
    assert (real / "checkpoints/last.ckpt").exists()
    (tmp_path / "broken.py").write_text("def reward(completions, **kwargs):\n    raise ValueError('not yet written')\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        fit("--trainer.max_steps=2", rewards=[{"name": "broken.py:reward"}])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "not yet written" in err and "runs/t/version_1 removed: the run failed before its first step" in err
    assert sorted(path.name for path in (tmp_path / "runs/t").iterdir()) == ["version_0"]

    fit("--trainer.max_steps=3", "--ckpt_path", "last")  # the real run, resumed in its own directory
    assert torch.load(real / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 3
    assert sorted(path.name for path in (tmp_path / "runs/t").iterdir()) == ["version_0"]
