"""reward_model: a tiny offline LlamaForSequenceClassification, compared with manual forwards."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from lit_grpo_rewards import RewardModel
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from lit_grpo import plugins
from lit_grpo.scoring import build_reward
from lit_grpo.tiny import build_tiny_model


def _seq_cls_dir(base, out, num_labels=1, seed=0):
    tokenizer = AutoTokenizer.from_pretrained(base)
    config = LlamaConfig.from_pretrained(base)
    config.num_labels = num_labels
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores well apart from 0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    base = build_tiny_model(tmp_path_factory.mktemp("tiny-base"), num_hidden_layers=1)
    return _seq_cls_dir(base, tmp_path_factory.mktemp("tiny-rm"))


@pytest.fixture(scope="module")
def manual(rm_dir):
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    model = LlamaForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()

    def score(text):  # one unpadded sequence at a time
        with torch.no_grad():
            return model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()

    return tokenizer, score


PROMPTS = ["Say a:", "Say b:", "Q: 6*7?", "", "x"]
COMPLETIONS = ["aaaa", "b", " 42, since 6*7 = 42.", "empty prompt", "y" * 40]


def test_string_inputs_match_a_manual_forward_for_any_batch_size(rm_dir, manual):
    _, score = manual
    expected = [score(p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert len(set(round(v, 4) for v in expected)) == len(expected)  # the texts score differently
    for batch_size in (2, 16, 1):
        rm = RewardModel(str(rm_dir), batch_size=batch_size, device="cpu")
        out = rm(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[0]] * len(PROMPTS))
        assert isinstance(out, list) and all(isinstance(v, float) for v in out)
        assert out == pytest.approx(expected, abs=1e-5)


def test_conversational_inputs_use_the_reward_models_chat_template(rm_dir, manual):
    tokenizer, score = manual
    prompts = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6*7?"}], [{"role": "user", "content": "Say a:"}]]
    completions = [[{"role": "assistant", "content": "42"}], [{"role": "assistant", "content": "aaa"}]]
    rm = RewardModel(str(rm_dir), batch_size=2)
    texts, templated = rm.texts(prompts, completions)
    assert templated and texts[0] == "<|system|>Be brief.\n<|user|>6*7?\n<|assistant|>42\n"
    expected = [score(tokenizer.apply_chat_template(p + c, tokenize=False)) for p, c in zip(prompts, completions)]
    assert rm(prompts=prompts, completions=completions) == pytest.approx(expected, abs=1e-5)
    plain = [score("6*7?42"), score("Say a:aaa")]
    assert rm(prompts=prompts, completions=completions) != pytest.approx(plain, abs=1e-3)


def test_lazy_loading_and_build_from_yaml_args(rm_dir):
    plugins.reset_plugins()
    reward = build_reward("reward_model", {"model_name_or_path": str(rm_dir), "batch_size": 2, "device": "cpu"})
    assert isinstance(reward, RewardModel) and reward._model is None and reward.__name__ == "reward_model"
    out = reward(prompts=["p", "q"], completions=["a", "b"], completion_ids=[[1], [2]])
    assert len(out) == 2 and reward._model is not None and not reward._model.training
    assert reward(prompts=[], completions=[]) == []


def test_max_length_truncates_from_the_left(rm_dir, manual):
    _, score = manual
    rm = RewardModel(str(rm_dir), max_length=8)
    assert rm(prompts=["0123456789"], completions=["abcdef"]) == pytest.approx([score("89abcdef")], abs=1e-5)


def test_num_labels_must_be_one(tmp_path, rm_dir):
    bad = _seq_cls_dir(rm_dir, tmp_path / "two-labels", num_labels=2)
    rm = RewardModel(str(bad))
    with pytest.raises(ValueError, match="num_labels=2; a reward model must output one score"):
        rm(prompts=["p"], completions=["c"])


def test_a_causal_lm_without_a_score_head_is_refused(tmp_path):
    base = build_tiny_model(tmp_path / "lm", num_hidden_layers=1)
    config = json.loads((base / "config.json").read_text())
    config["num_labels"] = 1
    config.pop("id2label", None)
    config.pop("label2id", None)
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no trained classification head"):
        RewardModel(str(base))(prompts=["p"], completions=["c"])


def test_missing_paths_are_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        RewardModel(str(missing))
    plugins.reset_plugins()
    with pytest.raises(plugins.RewardArgumentError, match="no-such-model' does not exist"):
        build_reward("reward_model", {"model_name_or_path": str(missing)})
    # a hub id cannot be checked up front; loading it offline fails with its name
    rm = RewardModel("no-such-org/no-such-reward-model")
    with pytest.raises(OSError, match="cannot load .* from 'no-such-org/no-such-reward-model'"):
        rm(prompts=["p"], completions=["c"])


def test_pad_token_falls_back_to_eos(tmp_path, tiny_model_dir_no_pad):
    out = tmp_path / "rm-no-pad"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir_no_pad)
    assert tokenizer.pad_token is None
    config = LlamaConfig.from_pretrained(tiny_model_dir_no_pad)
    config.num_labels, config.pad_token_id, config.num_hidden_layers = 1, None, 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    rm = RewardModel(str(out), batch_size=4)
    batched = rm(prompts=["a", "bb", "ccc"], completions=["1", "22", "333"])
    single = RewardModel(str(out), batch_size=1)(prompts=["a", "bb", "ccc"], completions=["1", "22", "333"])
    assert rm.tokenizer.pad_token == "</s>" and rm.model.config.pad_token_id == rm.tokenizer.eos_token_id
    assert batched == pytest.approx(single, abs=1e-5)


def test_device_resolution(monkeypatch, rm_dir):
    rm = RewardModel(str(rm_dir))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rm.resolve_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rm.resolve_device() == torch.device("cuda", 3)
    # once the trainer has selected its device, that one (devices=[1, 2] gives LOCAL_RANK 0 on cuda:1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rm.resolve_device() == torch.device("cuda", 1)
    assert RewardModel(str(rm_dir), device="cpu").resolve_device() == torch.device("cpu")


@pytest.mark.parametrize(
    "args, message",
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"max_length": 0}, "max_length must be an integer >= 1"),
        ({"dtype": "float8"}, "dtype must be one of float32, float16, bfloat16"),
        ({"device": ""}, "device must be a string"),
    ],
)
def test_bad_constructor_args(rm_dir, args, message):
    with pytest.raises(ValueError, match=message):
        RewardModel(str(rm_dir), **args)


def test_dtype_is_applied(rm_dir):
    rm = RewardModel(str(rm_dir), dtype="bfloat16")
    out = rm(prompts=["p"], completions=["c"])
    assert rm.model.dtype == torch.bfloat16 and isinstance(out[0], float)


def test_pickles_as_its_configuration(rm_dir):
    rm = RewardModel(str(rm_dir), batch_size=3, device="cpu")
    expected = rm(prompts=["p", "q"], completions=["a", "b"])
    copy = pickle.loads(pickle.dumps(rm))
    assert copy._model is None and repr(copy) == repr(rm)
    assert copy(prompts=["p", "q"], completions=["a", "b"]) == pytest.approx(expected, abs=1e-6)
