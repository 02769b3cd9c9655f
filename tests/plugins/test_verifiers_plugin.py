"""examples/verifiers-plugin (lit-grpo-verifiers) with the real verifiers package (pinned) and a verifiers
environment package installed from examples/verifiers-plugin/environments/vf_arithmetic (a ToolEnv whose
dataset is generated: no published one loads without a dataset hub). Its dataset feeds the prompts, its
rubric's functions score as verifiers scores them (each logged under its own name, with its weight), its
tool runs in lit-grpo's multi-turn rollout, and environments lit-grpo cannot drive are refused."""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import lightning.pytorch as pl
import lit_grpo_verifiers
import pytest
import torch
import verifiers as vf
from transformers import AutoTokenizer

from lit_grpo import GRPODataModule, GRPOModule, plugins
from lit_grpo.errors import UserError
from lit_grpo.rollout.tools.multi_turn import TurnOutput, run_conversations
from lit_grpo.rollout.tools.tool_use import ToolUse

ARGS = {"environment": "vf-arithmetic", "environment_args": {"num_examples": 8, "num_eval_examples": 4, "seed": 3}}


def data(**options) -> GRPODataModule:
    module = GRPODataModule(path="verifiers", args=ARGS, val_split="eval", **options)
    module.setup("fit")
    return module


def test_the_dataset_is_the_environment_s_own():
    env = vf.load_environment("vf-arithmetic", num_examples=8, num_eval_examples=4, seed=3)
    module = data(batch_size=2)
    assert module.train_dataset["prompt"] == list(env.get_dataset()["prompt"])
    assert module.train_dataset["answer"] == list(env.get_dataset()["answer"])
    assert module.val_dataset["answer"] == list(env.get_eval_dataset()["answer"])
    assert module.train_dataset["prompt"][0][0] == {"role": "system", "content": "You add numbers with the add tool."}


def completion(answer: str, call: bool) -> list[dict]:
    messages = []
    if call:
        messages += [{"role": "assistant", "content": "", "tool_calls": [
                         {"type": "function", "id": "call00000", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
                     {"role": "tool", "name": "add", "tool_call_id": "call00000", "content": "3"}]
    return messages + [{"role": "assistant", "content": answer}]


def test_the_rubric_functions_score_as_verifiers_scores_them():
    rows = data(batch_size=2).train_dataset
    completions = [completion(rows["answer"][0], call=True), completion("12 apples", call=False),
                   completion(rows["answer"][2], call=False), completion("", call=True)]
    batch = {"prompts": rows["prompt"][:4], "answer": rows["answer"][:4], "info": rows["info"][:4],
             "example_id": rows["example_id"][:4]}
    group = lit_grpo_verifiers.verifiers_rubric(**ARGS)
    assert [(reward.__name__, weight) for reward, weight in group] == [
        ("correct_answer", 1.0), ("digits_only", 0.2), ("num_turns", 0.0), ("total_tool_calls", 0.0), ("add_calls", 0.0)]
    ours = {reward.__name__: asyncio.run(reward(completions=completions, **batch)) for reward, _ in group}

    env = lit_grpo_verifiers.load(**ARGS)  # verifiers' own scoring of the same rollouts
    states = [lit_grpo_verifiers._state(p, c, a, i, None, e) for p, c, a, i, e in
              zip(batch["prompts"], completions, batch["answer"], batch["info"], batch["example_id"])]
    asyncio.run(env.rubric.score_group(states))
    assert ours == {name: [state["metrics"][name] for state in states] for name in ours}
    assert ours["correct_answer"] == [1.0, 0.0, 1.0, 0.0] and ours["add_calls"] == [1.0, 0.0, 0.0, 1.0]
    weights = {reward.__name__: weight for reward, weight in group}
    assert [sum(weights[name] * ours[name][i] for name in ours) for i in range(4)] == [state["reward"] for state in states]


def test_its_tools_run_in_the_multi_turn_rollout(tiny_qwen2_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    tool_use = ToolUse(None, {"name": "verifiers", "args": ARGS}, None, None, None)
    prompt = data(batch_size=2).train_dataset["prompt"][0]
    (conversation,) = tool_use.start([prompt], {}, 1, tokenizer, None, None)
    assert '"name": "add"' in tokenizer.decode(conversation.prompt_ids)  # the environment's tool, shown to the model
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call><|im_end|>'
    turns = iter([call, "42<|im_end|>"])

    def generate_turn(contexts, max_new_tokens):
        tokens = tokenizer(next(turns), add_special_tokens=False)["input_ids"]
        return [TurnOutput(tokens, None, True)]

    run_conversations([conversation], generate_turn, tokenizer, 128)
    assert [m["role"] for m in conversation.messages] == ["assistant", "tool", "assistant"]
    assert conversation.messages[1]["content"] == "42" and conversation.tool_calls == 1 and conversation.tool_failures == 0
    policy = [t for t, own in zip(conversation.token_ids, conversation.tool_mask) if own]
    assert tokenizer.decode(policy) == call + "42<|im_end|>"  # the policy's own tokens, as sampled; the tool's masked


def test_a_verifiers_environment_trains_with_its_rubric_logged(tmp_path, tiny_qwen2_dir):
    pl.seed_everything(0)
    module = GRPOModule(str(tiny_qwen2_dir), rewards=[{"name": "verifiers_rubric", "args": ARGS}],
                        environment={"name": "verifiers", "args": ARGS}, num_generations=2, max_completion_length=8,
                        model_init_kwargs={"dtype": "float32"}, log_completions_every_n_steps=0,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    assert module.scorer.names == ["correct_answer", "digits_only", "num_turns", "total_tool_calls", "add_calls"]
    assert module.scorer.weights.tolist() == pytest.approx([1.0, 0.2, 0.0, 0.0, 0.0])
    logger = pl.loggers.CSVLogger(tmp_path)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, log_every_n_steps=1, logger=logger,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, datamodule=GRPODataModule(path="verifiers", args=ARGS, batch_size=2))
    metrics = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    for name in ("correct_answer", "digits_only", "num_turns", "add_calls"):
        assert f"rewards/{name}/mean" in header
    num_turns = [row.split(",")[header.index("rewards/num_turns/mean")] for row in metrics[1:]]
    assert [float(value) for value in num_turns if value] and all(float(value) >= 1 for value in num_turns if value)


class EchoGame(vf.MultiTurnEnv):
    """A verifiers environment that answers every turn itself: it needs the model behind an endpoint."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


@pytest.fixture
def vf_echo_game(monkeypatch):
    module = types.ModuleType("vf_echo_game")
    module.load_environment = lambda: EchoGame(dataset=data(batch_size=2).train_dataset.select_columns(["question", "answer"]))
    monkeypatch.setitem(sys.modules, "vf_echo_game", module)
    lit_grpo_verifiers._load.cache_clear()
    yield
    lit_grpo_verifiers._load.cache_clear()


@pytest.mark.parametrize("args, message", [
    ({"environment": "vf-arithmetc"}, r"no verifiers environment 'vf-arithmetc' is installed .*did you mean 'vf-arithmetic'\?"),
    ({"environment": "vf-arithmetic", "environment_args": {"num_example": 4}},
     r"environment_args of verifiers environment 'vf-arithmetic'.*did you mean 'num_examples'\?"),
    ({"environment": "vf-echo-game"}, (r"verifiers environment 'vf-echo-game' \(EchoGame\) overrides EchoGame.env_response: it runs "
                                       r"a rollout of its own, driving the model through an OpenAI-compatible endpoint")),
])
def test_bad_names_arguments_and_environments_lit_grpo_cannot_drive_are_one_line_errors(args, message, vf_echo_game):
    with pytest.raises(UserError, match=message) as error:
        GRPODataModule(path="verifiers", args=args).setup("fit")
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match=message):
        GRPOModule("unused", rewards=[{"name": "verifiers_rubric", "args": args}])


def test_lit_grpo_environments_lists_what_the_plugin_brings(fresh_cli, capsys):
    from lit_grpo.cli import main

    main(["environments", "--json"])
    import json

    listed = {(entry["name"], entry["provides"]): entry["package"] for entry in json.loads(capsys.readouterr().out)}
    assert listed[("verifiers", "environment")] == listed[("verifiers", "data set")] == "lit-grpo-verifiers"
    assert listed[("verifiers_rubric", "reward")] == "lit-grpo-verifiers"
    assert plugins.get_rewards()["verifiers_rubric"].package == "lit-grpo-verifiers"
