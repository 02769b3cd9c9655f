"""lit-grpo from Python: functions, in-memory data and model objects into a plain ``lightning.Trainer``.

The Python path must behave as ``lit-grpo fit`` does: the same reward series for the same settings
and seed, exact resume, checkpoints and completions where Lightning puts a run's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import scripted_policy
from lit_grpo.data import GRPODataModule
from lit_grpo.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_ROWS = [json.loads(line) for line in (REPO / "configs/data/quickstart.jsonl").read_text().splitlines()]


def char_fraction(completions, target, **kwargs):
    """The fraction of each completion's characters equal to its target (the quickstart's reward)."""
    return [sum(c in want for c in text) / len(text) if text else 0.0 for text, want in zip(completions, target)]


def scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture
def one_thread(monkeypatch):
    """Bit-identical series need one thread (and no adaptation of the thread count)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def python_quickstart(model_dir, root: Path, steps: int, rewards=None, callbacks=(), ckpt_path=None, **trainer_kwargs):
    """The quickstart config, written in Python: a function reward, rows in memory, a plain Trainer."""
    from lit_grpo import GRPODataModule, GRPOModule

    pl.seed_everything(0)
    module = GRPOModule(str(model_dir), rewards=rewards or [char_fraction], num_generations=8, max_completion_length=16,
                        loss_type="dapo", epsilon_high=0.28, log_completions_every_n_steps=20,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3))
    data = GRPODataModule.from_data(datasets.Dataset.from_list(QUICKSTART_ROWS), batch_size=8, seed=0)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, log_every_n_steps=1, default_root_dir=str(root),
                         enable_progress_bar=False, callbacks=list(callbacks), **trainer_kwargs)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, trainer


def test_the_python_path_gives_the_reward_series_of_the_cli(tmp_path, tiny_model_dir, one_thread):
    steps = 12
    command = [str(Path(sys.executable).with_name("lit-grpo")), "fit", "--config", str(REPO / "configs/quickstart.yaml"),
               "--model.model_name_or_path", str(tiny_model_dir), "--data.data_files", str(REPO / "configs/data/quickstart.jsonl"),
               "--trainer.max_steps", str(steps)]
    with ThreadPoolExecutor(1) as beside:  # the command's run beside the one from Python: each on one thread
        cli_run = beside.submit(subprocess.run, command, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                capture_output=True, text=True, timeout=600)
        module, trainer = python_quickstart(tiny_model_dir, tmp_path / "python", steps)
        cli = cli_run.result()
    assert cli.returncode == 0, cli.stderr[-3000:]
    from_cli = scalars(tmp_path / "runs/quickstart/version_0")["reward"]

    from_python = scalars(Path(trainer.log_dir))["reward"]
    assert len(from_cli) == steps and from_python == from_cli  # identical, step by step
    run = Path(trainer.log_dir)
    assert (run / "completions.jsonl").is_file() and (run / "checkpoints/last.ckpt").is_file()
    checkpoint = torch.load(run / "checkpoints/last.ckpt", weights_only=False)
    assert checkpoint["hyper_parameters"]["rewards"] == ["test_python_api:char_fraction"]  # a name, not the function
    assert "RNGStateCheckpoint" in checkpoint["callbacks"]  # exact resume, as from the CLI
    assert scalars(run).get("rewards/char_fraction/mean")  # logged under the function's name


def test_resume_from_python_continues_exactly_and_needs_the_same_functions(tmp_path, tiny_model_dir, one_thread):
    def checkpoint_every_2():
        return pl.callbacks.ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=2)

    _, whole = python_quickstart(tiny_model_dir, tmp_path / "whole", 6, callbacks=[checkpoint_every_2()])
    _, first = python_quickstart(tiny_model_dir, tmp_path / "parts", 4, callbacks=[checkpoint_every_2()])
    last = Path(first.log_dir) / "checkpoints/last.ckpt"
    _, rest = python_quickstart(tiny_model_dir, tmp_path / "parts", 6, callbacks=[checkpoint_every_2()], ckpt_path=str(last))
    assert scalars(Path(rest.log_dir))["reward"] == scalars(Path(whole.log_dir))["reward"][4:]

    def renamed(completions, target, **kwargs):
        return char_fraction(completions, target)

    with pytest.raises(ConfigError, match=r"trained with the reward\(s\) \['test_python_api:char_fraction'\] given in Python"):
        python_quickstart(tiny_model_dir, tmp_path / "renamed", 6, rewards=[renamed], ckpt_path=str(last))


def test_sync_async_lambda_and_registered_rewards_together(tmp_path, tiny_model_dir, reward_plugin):
    async def async_length(completions, **kwargs):
        return [len(text) / 16 for text in completions]

    reward_plugin(registered=lambda completions, **kwargs: [0.5] * len(completions))
    rewards = [char_fraction, {"name": async_length, "weight": 0.5}, lambda completions, **kwargs: [1.0] * len(completions),
               {"name": "registered", "weight": 2.0}]
    module, trainer = python_quickstart(tiny_model_dir, tmp_path, 2, rewards=rewards)
    assert module.scorer.names == ["char_fraction", "async_length", "<lambda>", "registered"]
    assert module.scorer.weights.tolist() == [1.0, 0.5, 1.0, 2.0]
    logged = scalars(Path(trainer.log_dir))
    assert logged["rewards/<lambda>/mean"] == [1.0, 1.0] and logged["rewards/registered/mean"] == [0.5, 0.5]
    hparams = torch.load(Path(trainer.log_dir) / "checkpoints/last.ckpt", weights_only=False)["hyper_parameters"]
    assert hparams["rewards"][1] == {"name": "test_python_api:test_sync_async_lambda_and_registered_rewards_together.<locals>."
                                             "async_length", "weight": 0.5}


def test_a_model_object_trains_in_place_with_a_reference_copy_and_lora(tmp_path, tiny_model_dir):
    from lit_grpo import GRPOModule

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy.name_or_path = ""  # built in Python: no directory to load anything from
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    before = {name: weight.clone() for name, weight in policy.named_parameters()}
    module = GRPOModule(policy, rewards=[char_fraction], tokenizer=tokenizer, num_generations=4, max_completion_length=8,
                        beta=0.04, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    data = GRPODataModule.from_data(QUICKSTART_ROWS[:8], batch_size=2)
    pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               default_root_dir=str(tmp_path)).fit(module, datamodule=data)
    assert module.policy is policy  # trained in place
    assert any(not torch.equal(before[name], weight) for name, weight in policy.named_parameters())
    assert all(torch.equal(before[name], weight) for name, weight in module.ref_model.named_parameters())  # the copy
    assert module.hparams.model_name_or_path == ""

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora = GRPOModule(base, rewards=[char_fraction], tokenizer=tokenizer, num_generations=4, max_completion_length=8,
                      lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               default_root_dir=str(tmp_path)).fit(lora, datamodule=GRPODataModule.from_data(QUICKSTART_ROWS[:8], batch_size=2))
    trainable = [name for name, weight in lora.policy.named_parameters() if weight.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    with pytest.raises(ConfigError, match="already has a peft adapter"):
        GRPOModule(lora.policy, rewards=[char_fraction], tokenizer=tokenizer, lora={"r": 4}).configure_model()
    with pytest.raises(ConfigError, match="no name_or_path to load its tokenizer from: pass tokenizer="):
        GRPOModule(policy, rewards=[char_fraction])


class _NoCopy:
    """Mixed into a model or reward object: deep-copying it fails the test (issue 49.6)."""

    def __deepcopy__(self, memo):
        raise AssertionError(f"{type(self).__name__} was deep-copied")


class CharFractionReward(_NoCopy):
    """A reward given as an object (it could hold a reward model on the GPU)."""

    def __call__(self, completions, target, **kwargs):
        return char_fraction(completions, target)


def test_a_model_and_reward_objects_are_neither_copied_nor_warned_about(tmp_path, tiny_model_dir, recwarn):
    """Lightning deep-copies the hyperparameters it saves: a model object in them would be copied (a second
    7B model on the GPU) and warned about. The objects are the run's own, and hparams hold their names."""
    from lit_grpo import GRPOModule

    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loaded.__class__ = type("NoCopyModel", (_NoCopy, type(loaded)), {})
    reward = CharFractionReward()
    module = GRPOModule(loaded, rewards=[reward], num_generations=4, max_completion_length=8,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               default_root_dir=str(tmp_path)).fit(module, datamodule=GRPODataModule.from_data(QUICKSTART_ROWS[:8], batch_size=2))
    assert module.policy is loaded
    assert module.hparams.model_name_or_path == str(tiny_model_dir)
    assert module.hparams.rewards == ["test_python_api:CharFractionReward"]
    assert not [w for w in recwarn if "nn.Module" in str(w.message)], [str(w.message) for w in recwarn]


FSDP2_SCRIPT = """
import sys, torch, lightning.pytorch as pl
from transformers import AutoModelForCausalLM
sys.path[:0] = {tests!r}
from test_python_api import QUICKSTART_ROWS, char_fraction
from lit_grpo import GRPODataModule, GRPOModule
from lit_grpo.run.sharded_checkpoints import ModelParallelStrategy

pl.seed_everything(0)
policy = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.float32)
before = [weight.detach().clone() for weight in policy.parameters()]
module = GRPOModule(policy, rewards=[char_fraction], num_generations=4, max_completion_length=8,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
data = GRPODataModule.from_data(QUICKSTART_ROWS[:16], batch_size=2)
trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir={root!r})
trainer.fit(module, datamodule=data)
changed = sum(not torch.equal(b, w.full_tensor().detach()) for b, w in zip(before, module.policy.parameters()))
if trainer.global_rank == 0:
    print("CHANGED", changed, type(next(module.policy.parameters())).__name__)
"""


def test_a_model_object_under_fsdp2_on_two_processes(tmp_path, tiny_model_dir):
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2_SCRIPT.format(tests=[str(Path(__file__).resolve().parent), str(REPO / "tests")], model=str(tiny_model_dir), root=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("CHANGED"))
    _, changed, kind = line.split()
    assert int(changed) > 0 and kind == "DTensor"  # sharded, and trained


def test_tools_and_environments_as_python_objects(tiny_qwen2_dir, monkeypatch):
    import lit_grpo.rollout.engines.policy
    import lit_grpo.train.module
    from lit_grpo import GRPOModule

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    monkeypatch.setattr(lit_grpo.rollout.engines.policy, "generate_from_ids",
                        lambda *args, **kwargs: scripted_policy.scripted_generate_from_ids(*args, **kwargs, tokenizer=tokenizer))

    class Adder:
        """An environment given as a class."""

        def add(self, a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first number
                b: the second number
            """
            return a + b

        def get_reward(self) -> float:
            return 1.0

    for tools, environment in (([scripted_policy.add], None), (None, Adder)):
        module = GRPOModule(str(tiny_qwen2_dir), [char_fraction], num_generations=2, max_completion_length=128,
                            tools=tools, environment=environment, model_init_kwargs={"dtype": "float32"})
        module.configure_model()
        rollout = module.generate([[{"role": "user", "content": "once 4"}]], 2)
        assert [m["content"] for m in rollout.conversations[0].messages if m["role"] == "tool"] == ["5"]
        assert module.hparams.tools == (["scripted_policy:add"] if tools else None)
    assert module.tool_use.reward_names == ["Adder"] and module.hparams.environment.endswith(":test_tools_and_environments_"
                                                                                            "as_python_objects.<locals>.Adder")


@pytest.mark.parametrize("given", ["dataset", "list", "dataset_dict"])
def test_data_given_in_python_is_formatted_and_checked_as_a_file(given, write_jsonl):
    rows = [{"question": f"{i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    options = dict(prompt_template="Q: {question}", system_prompt="Be brief.", batch_size=2, shuffle=False)
    from_file = GRPODataModule(path="json", data_files=str(write_jsonl(rows)), **options)
    data = {"dataset": datasets.Dataset.from_list(rows), "list": rows,
            "dataset_dict": datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})}[given]
    from_python = GRPODataModule.from_data(data, val=rows[:2], **options)
    from_file.setup("fit")
    from_python.setup("fit")
    assert list(from_python.train_dataloader()) == list(from_file.train_dataloader())
    assert next(iter(from_python.val_dataloader())).prompts[0] == [{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "Q: 0 + 0?"}]
    with pytest.raises(DataError, match="prompt_template names column 'questoin', which the training data given in Python"):
        GRPODataModule.from_data(data, prompt_template="{questoin}").setup("fit")


def test_bad_data_objects_are_named():
    with pytest.raises(DataError, match="must be a datasets.Dataset, a DatasetDict or a list of row dicts, got str"):
        GRPODataModule.from_data("prompts.jsonl")
    with pytest.raises(DataError, match="has no split 'train'; its splits are \\['test'\\]"):
        GRPODataModule.from_data(datasets.DatasetDict({"test": datasets.Dataset.from_list([{"prompt": "a"}])}))


def test_importing_lit_grpo_stays_cheap_and_exports_the_modules():
    code = ("import sys, lit_grpo\nassert 'torch' not in sys.modules\n"
            "from lit_grpo import GRPOModule, GRPODataModule\nprint(GRPOModule.__module__, GRPODataModule.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["lit_grpo.train.module", "lit_grpo.data"]


def test_the_example_script_learns(tmp_path):
    """examples/python_api.py as a user runs it (shortened: 60 steps)."""
    result = subprocess.run([sys.executable, str(REPO / "examples/python_api.py"), "--steps", "60", "--out", str(tmp_path)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import re

    first, last = map(float, re.search(r"first 10 steps ([\d.]+), of the last 10 ([\d.]+)", result.stdout).groups())
    assert first < 0.1 and last > first + 0.2
    # lit-grpo's checkpointing in place of Lightning's default is the intent, not news to the user
    assert "will override existing callbacks" not in result.stdout + result.stderr


def test_a_model_object_without_a_directory_is_refused_by_the_vllm_engine_in_one_line(tiny_model_dir):
    """vLLM builds its engine from a directory: a policy built in Python (no name_or_path) is refused
    before any engine is built, with the fix, also where vLLM is not installed."""
    from types import SimpleNamespace

    from lit_grpo.rollout.engines.vllm_colocated import ColocatedVLLMEngine

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy.name_or_path = ""
    hp = SimpleNamespace(model_name_or_path="", vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=False,
                         vllm_tensor_parallel_size=1, vllm_max_model_length=None, max_prompt_length=None,
                         max_completion_length=8)
    with pytest.raises(ConfigError) as error:
        ColocatedVLLMEngine.for_run(hp, policy, "32-true", grows_with_tools=False)
    assert str(error.value) == ("model.generation_backend: vllm builds its engine from a directory: save the "
                                "LlamaForCausalLM given in Python (no name_or_path) with save_pretrained(DIR) and give DIR")
