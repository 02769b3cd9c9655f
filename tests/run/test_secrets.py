"""Secrets are kept out of everything a run writes (lit_grpo/redaction.py): ``config.yaml``, ``hparams.yaml``,
checkpoints, TensorBoard's events; the run itself keeps the real values, and resuming and exporting from
the redacted files still work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from lit_grpo import plugins
from lit_grpo.cli import main
from lit_grpo.redaction import REDACTED, is_secret_name, redact_secrets, redact_text, restore_redacted, without_redacted

REPO = Path(__file__).resolve().parents[2]

SECRET_NAMES = ["api_key", "token", "hf_token", "HF_TOKEN", "hubToken", "access_token", "use_auth_token", "openaiApiKey",
                "x-api-key", "password", "db_password", "passwd", "client_secret", "secret", "credentials", "apikey",
                "Authorization", "private_key", "aws_secret_access_key", "api_keys", "auth_token", "api_token",
                "refresh_token", "bearer_token", "signing_key", "encryption_key", "ssh_key", "session_key",
                "master_key", "license_key", "client_key", "access_keys", "openai_key"]
KEPT_NAMES = ["max_tokens", "max_completion_tokens", "tokenizer", "tokenizer_name", "pad_token", "eos_token", "bos_token",
              "token_mask", "token_ids", "num_tokens", "special_tokens", "forward_token_budget", "key", "keys", "keyword",
              "vllm_importance_sampling_mode", "importance_sampling_level", "model_name_or_path", "monkey", "turnkey",
              # column names and marker tokens: a config.yaml that redacted them would not run again
              "answer_key", "label_key", "prompt_key", "text_key", "sort_key", "think_token", "stop_token", "end_token",
              "start_token", "eot_token", "im_start_token", "im_end_token", "tool_call_token", "unk_token", "sep_token",
              "cls_token", "mask_token", "image_token", "video_token", "audio_token",
              # counts, rates and positions (lit_grpo's bytes_per_token): a number, not a secret
              "bytes_per_token", "first_token", "last_token", "next_token", "target_token", "reward_token", "num_token"]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_names_like_key_token_secret_password_credential_are_secret(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", KEPT_NAMES)
def test_settings_that_only_look_like_secrets_are_kept(name):
    assert not is_secret_name(name)


def test_redacted_values_and_urls():
    settings = {
        "vllm_importance_sampling_mode": "token_mask", "max_tokens": 64, "pad_token": "<pad>", "tokenizer": "gpt2",
        "model_init_kwargs": {"token": "hf_abc", "dtype": "bfloat16", "use_auth_token": True},
        "rewards": [{"name": "judge", "args": {"api_key": "sk-1", "key": "answer", "url": "http://u:pw@host:8000/v1"}}],
        "credentials": {"user": "me", "pass": "x", "port": 5},
        "vllm_server_urls": ["http://user:pw@h:8000", "http://h:8001", "https://ghp_tok@github.com/a.git",
                             "http://h/v1?api_key=sk-2&model=m"],
    }
    assert redact_secrets(settings) == {
        "vllm_importance_sampling_mode": "token_mask", "max_tokens": 64, "pad_token": "<pad>", "tokenizer": "gpt2",
        "model_init_kwargs": {"token": REDACTED, "dtype": "bfloat16", "use_auth_token": True},
        "rewards": [{"name": "judge", "args": {"api_key": REDACTED, "key": "answer", "url": f"http://u:{REDACTED}@host:8000/v1"}}],
        "credentials": {"user": REDACTED, "pass": REDACTED, "port": 5},
        "vllm_server_urls": [f"http://user:{REDACTED}@h:8000", "http://h:8001", f"https://{REDACTED}@github.com/a.git",
                             f"http://h/v1?api_key={REDACTED}&model=m"],
    }
    assert settings["model_init_kwargs"]["token"] == "hf_abc"  # a copy: the live settings keep the real values
    assert redact_text("user@example.com, a=b, http://host:8000/p@q") == "user@example.com, a=b, http://host:8000/p@q"
    # read back: the library finds a secret left out itself (HF_TOKEN); a resume takes it from the config given now
    assert without_redacted(redact_secrets(settings))["model_init_kwargs"] == {"dtype": "bfloat16", "use_auth_token": True}
    assert restore_redacted(redact_secrets(settings), settings) == settings
    with pytest.raises(LookupError, match=r"^'?rewards\[0\]\.args\.api_key"):
        restore_redacted(redact_secrets(settings), {**settings, "rewards": [{"name": "judge", "args": {}}]})


def test_secrets_in_dataclasses_namespaces_numbers_query_parameters_and_authorization_headers():
    import argparse

    from lit_grpo.scoring.specs import RewardSpec

    # a RewardSpec given in Python is written as the mapping YAML gives (a checkpoint holds plain values only)
    spec = RewardSpec("judge", args={"api_key": "sk-1", "answer_key": "answer"})
    assert redact_secrets({"rewards": [spec]}) == {
        "rewards": [{"name": "judge", "weight": 1.0, "args": {"api_key": REDACTED, "answer_key": "answer"},
                     "on_error": "raise", "num_workers": 0, "timeout": None}]}
    assert spec.args["api_key"] == "sk-1"
    namespace = redact_secrets({"options": argparse.Namespace(token="hf_x", think_token="<think>")})["options"]
    assert isinstance(namespace, argparse.Namespace) and vars(namespace) == {"token": REDACTED, "think_token": "<think>"}
    assert redact_secrets({"api_key": 123456, "api_keys": ["a", "b"], "use_auth_token": True, "credentials": {"port": 5},
                           "pin": 1234, "max_tokens": 64}) == {
        "api_key": REDACTED, "api_keys": [REDACTED, REDACTED], "use_auth_token": True, "credentials": {"port": 5},
        "pin": 1234, "max_tokens": 64}
    for parameter in ("key", "sig", "signature", "X-Amz-Signature", "access_token", "X-Amz-Credential", "token"):
        assert redact_text(f"https://h/o?a=1&{parameter}=SECRET9&b=2") == f"https://h/o?a=1&{parameter}={REDACTED}&b=2"
    assert redact_text("https://h/o?sort_key=date&page=2") == "https://h/o?sort_key=date&page=2"
    assert redact_text("Authorization: Bearer abc.DEF-123") == f"Authorization: Bearer {REDACTED}"
    assert redact_text("-H 'Authorization: Basic dXNlcjpwdw=='") == f"-H 'Authorization: Basic {REDACTED}'"
    assert redact_text("Authorization: sk-RAW") == f"Authorization: {REDACTED}"
    assert redact_text("headers: Bearer xxx") == f"headers: Bearer {REDACTED}"
    assert redact_text("a plain sentence with a token in it") == "a plain sentence with a token in it"
    settings = {"rewards": [{"args": {"api_key": 123456, "header": "Bearer xyz"}}]}
    assert restore_redacted(redact_secrets(settings), settings) == settings


# --------------------------------------------------------------------------------------------------
# A run with planted secrets, through the command, with a user's defaults (TensorBoard logger)
# --------------------------------------------------------------------------------------------------

PLANTED = {"api_key": "sk-PLANTEDkey31415", "token": "hf_PLANTEDtoken2718", "password": "PLANTEDpassword1618",
           "server_password": "PLANTEDPW"}
SERVER_URL = f"http://user:{PLANTED['server_password']}@host:8000"


def test_a_run_writes_no_planted_secret_and_resumes_and_exports_with_the_real_ones(tmp_path, tiny_qwen2_dir, monkeypatch, fresh_cli):
    monkeypatch.chdir(tmp_path)
    seen = []  # what the live reward and environment got

    def judged(completions, api_key, judge_url, **kwargs):
        seen.append((api_key, judge_url))
        return [0.5] * len(completions)

    class Vault:
        """An environment whose constructor takes a password."""

        def __init__(self, password: str):
            seen.append(password)

        def open_vault(self) -> str:
            """Open the vault."""
            return "open"

    registered = plugins.register_functions("test-secrets", rewards={"judged": judged}, environments={"vault": Vault})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {c}:"}) + "\n" for c in "ab"))
    config = {  # no logger: lit-grpo's default, TensorBoard under runs/lit-grpo
        "seed_everything": 0,
        "trainer": {"max_steps": 2, "accelerator": "cpu", "devices": 1, "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"model_name_or_path": str(tiny_qwen2_dir), "num_generations": 2, "max_completion_length": 4,
                  "log_completions_every_n_steps": 1,
                  "model_init_kwargs": {"token": PLANTED["token"], "dtype": "float32"},
                  "rewards": [{"name": "judged", "args": {"api_key": PLANTED["api_key"], "judge_url": SERVER_URL}}],
                  "environment": {"name": "vault", "args": {"password": PLANTED["password"]}}},
        "data": {"path": "json", "data_files": str(tmp_path / "prompts.jsonl"), "batch_size": 2},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    try:
        main(["fit", "--config", "config.yaml"])
        run = tmp_path / "runs/lit-grpo/version_0"
        checkpoint = run / "checkpoints/last.ckpt"
        assert (run / "hparams.yaml").is_file() and list(run.glob("events.out.tfevents.*")) and checkpoint.is_file()
        assert seen[0] == PLANTED["password"] and (PLANTED["api_key"], SERVER_URL) in seen  # the run had the real ones
        assert_no_planted_secret(run)
        hparams = torch.load(checkpoint, weights_only=True)["hyper_parameters"]
        assert hparams["model_init_kwargs"] == {"token": REDACTED, "dtype": "float32"}
        assert hparams["rewards"][0]["args"] == {"api_key": REDACTED, "judge_url": f"http://user:{REDACTED}@host:8000"}

        # resumed from that checkpoint file (whose hyperparameters Lightning lays over the config): the real values
        seen.clear()
        main(["fit", "--config", "config.yaml", "--ckpt_path", str(checkpoint), "--trainer.max_steps", "3"])
        assert seen and all(item in (PLANTED["password"], (PLANTED["api_key"], SERVER_URL)) for item in seen)
        assert torch.load(checkpoint, weights_only=True)["global_step"] == 3
        assert_no_planted_secret(run)

        # exported from the redacted checkpoint: the token left out, for huggingface_hub to find (HF_TOKEN)
        from lit_grpo.run import export
        built = []
        build_policy = export.models.build_policy
        monkeypatch.setattr(export.models, "build_policy", lambda *a, **k: (built.append(a[1]), build_policy(*a, **k))[1])
        main(["export", str(checkpoint), str(tmp_path / "exported")])
        assert (tmp_path / "exported/config.json").is_file() and "token" not in built[0]
    finally:
        plugins.unregister_plugin(registered)


def assert_no_planted_secret(run: Path) -> None:
    """No planted value in any file of ``run`` (raw bytes: YAML, events, the checkpoint's pickle), nor in
    its checkpoints as loaded."""
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        content = path.read_bytes()
        for value in PLANTED.values():
            assert value.encode() not in content, f"{value} is written in {path.relative_to(run)}"
        if path.suffix == ".ckpt":
            loaded = repr(torch.load(path, weights_only=True))
            assert not any(value in loaded for value in PLANTED.values()), path


def test_a_message_that_quotes_settings_shows_no_secret():
    from lit_grpo.redaction import redact_message

    assert redact_message("model.model_init_kwargs.token: 'hf_x y' is not valid") == (
        f"model.model_init_kwargs.token: '{REDACTED}' is not valid")
    assert redact_message("{'token': 'hf_x', 'dtype': 'bfloat16'}") == f"{{'token': '{REDACTED}', 'dtype': 'bfloat16'}}"
    assert redact_message('{"password": "two words"}, api_key=sk-1, max_tokens=5') == (
        f'{{"password": "{REDACTED}"}}, api_key={REDACTED}, max_tokens=5')
    assert redact_message("data.path 'https://user:pw@host/d': no such file") == f"data.path 'https://user:{REDACTED}@host/d': no such file"
    assert redact_message("Authorization: Bearer abc") == f"Authorization: Bearer {REDACTED}"
    for kept in ("pad_token: <pad>", "max_tokens=64", "key: answer", "a plain sentence with a token in it"):
        assert redact_message(kept) == kept
    # the hints of errors keep their placeholders
    for hint in ("export VLLM_API_KEY=KEY", "export VLLM_API_KEY=$(python -c 'import secrets')", "api_key=...",
                 f"token: {REDACTED}"):
        assert redact_message(hint) == hint


def test_a_message_redacts_every_secret_after_any_setting_and_a_bracketed_value_whole():
    """Review of issue 50, D1/D2: a setting's value never swallows the secret assignment after it, a list or a
    dict under a secret name is redacted whole, and the command that resumes a run shows no YAML-flow secret."""
    from lit_grpo.cli import resume_command
    from lit_grpo.redaction import redact_message

    assert redact_message("model.model_init_kwargs: token=hf_LEAK is unknown") == (
        f"model.model_init_kwargs: token={REDACTED} is unknown")
    assert redact_message("rewards[0].args: api_key: sk-LEAK") == f"rewards[0].args: api_key: {REDACTED}"
    assert redact_message("reward args: api_key=sk-LEAK rejected") == f"reward args: api_key={REDACTED} rejected"
    assert redact_message("rewards[0]: {name: judge, args: {api_key: sk-LEAK}} failed") == (
        f"rewards[0]: {{name: judge, args: {{api_key: {REDACTED}}}}} failed")
    assert redact_message("{'password': ['LEAK1', 'LEAK2']}, dtype=bf16") == f"{{'password': {REDACTED}}}, dtype=bf16"
    assert redact_message("{'credentials': {'user': 'LEAK', 'pw': 'LEAK'}} failed") == (
        f"{{'credentials': {REDACTED}}} failed")
    shown = resume_command(["fit", "--model.rewards", "[{name: judge, args: {api_key: sk-LEAK1}}]",
                            "--model.model_init_kwargs={token: hf_LEAK2}", "--ckpt_path", "x.ckpt"])
    assert shown == ("lit-grpo fit --model.rewards '[{name: judge, args: {api_key: <redacted>}}]' "
                     "'--model.model_init_kwargs={token: <redacted>}' --ckpt_path last")


def test_a_message_keeps_counts_and_positions_named_like_tokens():
    """Review of issue 50, S2: ``bytes_per_token=4.0`` (a real setting) and other counts are no secrets; a
    number right under a key, a secret or a password still is."""
    from lit_grpo.redaction import redact_message

    for kept in ("bytes_per_token=4.0", "reward_token=3", "first_token=12", "model.reward_token: 'x' not found",
                 "prefix_token=-3", "max_new_tokens=8"):
        assert redact_message(kept) == kept
    assert redact_message("api_key: 123456, password=42, token=hf_x") == (
        f"api_key: {REDACTED}, password={REDACTED}, token={REDACTED}")
    assert redact_secrets({"bytes_per_token": 4.0, "token": 5}) == {"bytes_per_token": 4.0, "token": REDACTED}


def test_a_server_url_with_credentials_is_printed_without_them(capsys):
    """Review of issue 50, D3: the lines said while a vLLM server does not answer show its URL's password
    redacted; requests still go to the real URL (its credentials in the request)."""
    import socket
    import threading

    from lit_grpo.rollout.engines.server_lost import GenerationServerLost
    from lit_grpo.rollout.engines.vllm_server_api import VLLMServer

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = VLLMServer(f"http://user:{PLANTED['server_password']}@127.0.0.1:{port}", timeout=1)
    said = []
    with pytest.raises(GenerationServerLost):
        server.generate({"prompt": [1, 2]}, threading.Event(), lambda _, message: said.append(message))
    assert server.url == SERVER_URL.replace("host:8000", f"127.0.0.1:{port}")  # the real one, for the requests
    assert len(said) == 1 and f"the vLLM server at http://user:{REDACTED}@127.0.0.1:{port} is not answering" in said[0]
    assert PLANTED["server_password"] not in said[0]

    vllm_server = pytest.importorskip("lit_grpo.rollout.engines.vllm_server")
    pytest.importorskip("vllm")  # the engine's weight transfer is vLLM's (the README's vLLM block)
    engine = vllm_server.VLLMServerEngine([server.url], timeout=1)
    capsys.readouterr()
    with pytest.raises(GenerationServerLost):
        engine.sample([([1, 2], {"n": 1, "max_tokens": 2})])
    assert f"user:{REDACTED}@127.0.0.1" in capsys.readouterr().err
    assert not engine._wait_for_servers(0.0, GenerationServerLost(f"lost {server.url}"))
    err = capsys.readouterr().err
    assert f"lost http://user:{REDACTED}@127.0.0.1:{port}: waiting" in err and PLANTED["server_password"] not in err


def test_the_traceback_on_request_shows_the_errors_message_redacted(monkeypatch, fresh_cli):
    """Review of issue 50, S1: LIT_GRPO_TRACEBACK=1 re-raises the error with its message redacted as the
    ``error:`` line shows it."""
    from lit_grpo import cli
    from lit_grpo.errors import ConfigError

    def refused(argv):
        raise ConfigError(f"rewards[0].args: api_key={PLANTED['api_key']} was refused by {SERVER_URL}")

    monkeypatch.setitem(cli.SUBCOMMANDS, "rewards", refused)
    monkeypatch.setenv("LIT_GRPO_TRACEBACK", "1")
    with pytest.raises(ConfigError) as raised:
        main(["rewards"])
    assert str(raised.value) == f"rewards[0].args: api_key={REDACTED} was refused by http://user:{REDACTED}@host:8000"
