"""examples/openenv-plugin (lit-grpo-openenv) against a real OpenEnv server (openenv-core, pinned) that the
test starts on a free loopback port: examples/openenv-plugin/guess_number_env, an OpenEnv environment in
OpenEnv's own layout, served with uvicorn. Every rollout resets its own session, its steps are tool calls,
its reward is the environment's."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import lightning.pytorch as pl
import lit_grpo_openenv
import pytest
import torch
from transformers import AutoTokenizer

from lit_grpo import GRPODataModule, GRPOModule, plugins
from lit_grpo.errors import UserError
from lit_grpo.rollout.tools.multi_turn import TurnOutput, run_conversations
from lit_grpo.rollout.tools.tool_use import ToolUse


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """guess-number's OpenEnv server on a free loopback port, stopped after the module's tests."""
    port = free_port()
    log = tmp_path_factory.mktemp("openenv-server") / "server.log"  # a file: a full pipe would stall the server
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "uvicorn", "guess_number_env.server.app:app", "--host", "127.0.0.1",
                                    "--port", str(port), "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # up to 30 s for the import and the bind
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"the OpenEnv server exited: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        else:
            raise RuntimeError("the OpenEnv server did not answer within 30 s")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a session it still waits on
            process.kill()
            process.wait()


def guesses(tokenizer, numbers: list[int]):
    """generate_turn for run_conversations: every rollout guesses ``numbers`` in turn, then answers."""
    def turn(number: int | None) -> list[int]:
        text = f'<tool_call>\n{{"name": "step", "arguments": {{"guess": {number}}}}}\n</tool_call>' if number else "Done."
        return tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]

    def generate_turn(contexts, max_new_tokens):
        outputs = []
        for context in contexts:
            made = tokenizer.decode(context).count("<tool_response>")  # the guesses answered so far
            outputs.append(TurnOutput(turn(numbers[made] if made < len(numbers) else None), None, True))
        return outputs

    return generate_turn


def test_rollouts_reset_their_own_episode_and_step_through_the_tool(server, tiny_qwen2_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    tool_use = ToolUse(None, {"name": "openenv", "args": {"base_url": server}}, None, None, None)
    data = lit_grpo_openenv.openenv_dataset("train", server, size=3, seed=11, prompt_field="hint")
    assert data["seed"] == [11, 12, 13] and data["prompt"][0].startswith("Guess a number from 1 to 8")
    prompts = [[{"role": "user", "content": prompt}] for prompt in data["prompt"]]
    conversations = tool_use.start(prompts, {"seed": data["seed"]}, 2, tokenizer, None, None)  # 6 rollouts
    assert len({id(c.environment_instance) for c in conversations}) == 6  # a session each
    assert '"name": "step"' in tokenizer.decode(conversations[0].prompt_ids) and '"guess"' in tokenizer.decode(conversations[0].prompt_ids)
    secrets = [__import__("random").Random(seed).randint(1, 8) for seed in data["seed"]]
    run_conversations(conversations, guesses(tokenizer, [8, 1, 5]), tokenizer, 512, max_tool_calling_iterations=5)
    tool_use.read_environment_rewards(conversations)
    for row, conversation in enumerate(conversations):
        secret = secrets[row // 2]
        hints = [json.loads(m["content"])["hint"] for m in conversation.messages if m["role"] == "tool"
                 and not m["content"].startswith("error")]
        expected = []
        for number in (8, 1, 5):
            expected.append("correct" if number == secret else "higher" if number < secret else "lower")
            if number == secret:
                break
        assert hints == expected  # the server's answers, in the episode its seed set up
        assert conversation.environment_reward == (1.0 if secret in (8, 1, 5) else 0.0)
    tool_use.close(conversations)
    assert all(c.environment_instance is None for c in conversations)


def test_a_few_training_steps_log_the_environment_s_reward(server, tiny_qwen2_dir, tmp_path):
    pl.seed_everything(0)
    args = {"base_url": server}
    module = GRPOModule(str(tiny_qwen2_dir), rewards=[{"name": "char_fraction", "args": {"chars": "5"}}],
                        environment={"name": "openenv", "args": args}, num_generations=2, max_completion_length=8,
                        model_init_kwargs={"dtype": "float32"}, log_completions_every_n_steps=0,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    logger = pl.loggers.CSVLogger(tmp_path)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, log_every_n_steps=1, logger=logger, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    data = GRPODataModule(path="openenv", args={**args, "size": 4, "prompt_field": "hint"}, batch_size=2, conversational=True)
    trainer.fit(module, datamodule=data)
    rows = (tmp_path / "lightning_logs/version_0/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "rewards/openenv/mean" in header and "tools/calls_per_rollout" in header
    assert [row.split(",")[header.index("rewards/openenv/mean")] for row in rows[1:] if row.split(",")[header.index("rewards/openenv/mean")]]


@pytest.mark.parametrize("environment, message", [
    ({"name": "openenv", "args": {"base_ulr": "http://127.0.0.1:9"}}, r"unexpected keyword argument 'base_ulr'; did you mean 'base_url'\?"),
    ({"name": "openenvv", "args": {}}, r"Unknown environment 'openenvv'. Did you mean 'openenv'\?"),
])
def test_bad_names_and_arguments_are_one_line_errors(environment, message, tiny_qwen2_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    with pytest.raises(UserError, match=message) as error:
        ToolUse(None, environment, None, None, None).start(["Guess."], {}, 1, tokenizer, None, None)
    assert "\n" not in str(error.value)


def test_a_server_that_is_not_there_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    lit_grpo_openenv.action_schema.cache_clear()
    with pytest.raises(UserError, match=rf"no OpenEnv server answers at base_url '{url}'") as error:
        GRPODataModule(path="openenv", args={"base_url": url}).setup("fit")
    assert "\n" not in str(error.value)


def test_lit_grpo_environments_lists_it(fresh_cli, capsys):
    from lit_grpo.cli import main

    main(["environments", "--json"])
    listed = {(entry["name"], entry["provides"]): entry["package"] for entry in json.loads(capsys.readouterr().out)}
    assert listed[("openenv", "environment")] == listed[("openenv", "data set")] == "lit-grpo-openenv"
    assert plugins.get_environments()["openenv"].obj is lit_grpo_openenv.OpenEnvEnvironment
