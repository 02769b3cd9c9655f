"""The quickstart from Python: a reward function, prompts in memory, a plain ``lightning.Trainer``.

    python examples/python_api.py                 # about a minute on 2 CPU cores; the reward rises
    python examples/python_api.py --steps 40 --out runs-python

It trains the tiny random model of ``lit-grpo init-tiny`` (written to ``--out``/tiny-model) to
answer "Say a:" with a's, as ``configs/quickstart.yaml`` does, with no YAML and no plugin: the
reward is the function below, the prompts a list of dicts, the logger and checkpoints Lightning's
own (``--out``/lightning_logs/version_N). The same settings as the CLI run give the same rewards.
"""

from __future__ import annotations

import lit_grpo  # noqa: F401  # first: it picks how torch's CPU threads wait, before torch loads (README: Performance)

# isort: split
import argparse
import random
from pathlib import Path

import lightning.pytorch as pl
import torch

from lit_grpo import GRPODataModule, GRPOModule
from lit_grpo.tiny import build_tiny_model


def says_the_target(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """The fraction of each completion's characters equal to its prompt's target (TRL's signature:
    the completions, then each dataset column as a list, then ``**kwargs``)."""
    return [sum(character == want for character in text) / len(text) if text else 0.0 for text, want in zip(completions, target)]


def prompts(count: int = 64, seed: int = 0) -> list[dict]:
    """``{"prompt": "Say b:", "target": "b"}`` rows over a few letters."""
    rng = random.Random(seed)
    letters = [rng.choice("abc") for _ in range(count)]
    return [{"prompt": f"Say {letter}:", "target": letter} for letter in letters]


class RewardCurve(pl.Callback):
    """Keeps the mean reward of every step (what TensorBoard shows as ``reward``)."""

    def __init__(self) -> None:
        self.rewards: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rewards.append(float(trainer.callback_metrics["reward"]))


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=Path("runs-python"))
    args = parser.parse_args(argv)

    pl.seed_everything(0)
    model_dir = build_tiny_model(args.out / "tiny-model")
    module = GRPOModule(
        str(model_dir),
        rewards=[says_the_target],
        num_generations=8,
        max_completion_length=16,
        loss_type="dapo",
        epsilon_high=0.28,
        log_completions_every_n_steps=20,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )
    data = GRPODataModule.from_data(prompts(), batch_size=8, seed=0)
    curve = RewardCurve()
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, log_every_n_steps=1,
                         default_root_dir=str(args.out), enable_progress_bar=False, callbacks=[curve])
    trainer.fit(module, datamodule=data)
    first, last = sum(curve.rewards[:10]) / 10, sum(curve.rewards[-10:]) / 10
    print(f"mean reward of the first 10 steps {first:.3f}, of the last 10 {last:.3f} "
          f"(logs, completions and checkpoints: {trainer.log_dir})")
    return curve.rewards


if __name__ == "__main__":
    main()
