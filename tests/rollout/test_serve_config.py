"""Issue 50.1: ``lit-grpo serve MODEL --config FILE.yaml`` (vLLM's own option: a YAML mapping of its
options) is read as vLLM 0.32's ``FlexibleArgumentParser`` reads it, and its options are checked as the
command line's: a host beyond loopback needs an API key, a key in the file is the key, the command line
overrides the file, a file that cannot be read is one line naming it. Without vLLM (the command
``lit-grpo serve`` builds); the last test, where vLLM is installed, parses that command with vLLM's own
parser."""

from __future__ import annotations

import os

import pytest

from lit_grpo.errors import ConfigError
from lit_grpo.rollout.engines.vllm_auth import API_KEY_VARIABLE
from lit_grpo.rollout.engines.vllm_serve import server_command

KEY = "key-from-the-config-file"


def option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@pytest.fixture
def config_file(tmp_path):
    """``config_file(text, name="serve.yaml") -> path``: a config file holding ``text``."""

    def write(text: str, name: str = "serve.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


def serve(*words: str, environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    return server_command(["MODEL", *words], on_cpu=True, environ=environ or {})


def refusal(*words: str) -> str:
    with pytest.raises(ConfigError) as refused:
        serve(*words)
    said = str(refused.value)
    assert "\n" not in said
    return said


def test_a_host_in_the_config_file_needs_a_key_as_on_the_command_line(config_file):
    path = config_file("host: 0.0.0.0\nport: 8011\n")
    said = refusal("--config", path)
    assert said.startswith(f"lit-grpo serve --config {path} (host: 0.0.0.0): without an API key"), said
    assert f"export {API_KEY_VARIABLE}=" in said

    # with a key, the file's host is the one vLLM binds: no loopback added after it (which would override it)
    command, environ = serve("--config", path, environ={API_KEY_VARIABLE: "k"})
    assert "--host" not in command and option(command, "--config") == path and environ[API_KEY_VARIABLE] == "k"


@pytest.mark.parametrize("spelling", ["api_key", "api-key"])
def test_a_key_in_the_config_file_is_the_key_the_middleware_and_the_trainer_use(config_file, spelling):
    path = config_file(f"host: 0.0.0.0\n{spelling}: {KEY}\n")
    command, environ = serve("--config", path)
    assert environ[API_KEY_VARIABLE] == KEY and KEY not in " ".join(command)
    command, environ = serve("--config", path, environ={API_KEY_VARIABLE: KEY})  # the same key exported too: one key
    assert environ[API_KEY_VARIABLE] == KEY  # vLLM guards its own endpoints with the file's key: the same one
    # another key exported: a trainer run from this shell would send it and be refused (401) at its first push
    with pytest.raises(ConfigError) as refused:
        serve("--config", path, environ={API_KEY_VARIABLE: "other"})
    assert str(refused.value) == (f"lit-grpo serve --config {path}: its api-key differs from the {API_KEY_VARIABLE} "
                                  f"exported here: give one key, in one place (unset {API_KEY_VARIABLE} or drop api-key)")
    assert "other" not in str(refused.value) and KEY not in str(refused.value)
    assert refusal("--config", path, "--api-key", "second") == (
        f"lit-grpo serve --api-key: --config {path} gives an api-key too: give one key, in one place")
    for not_one_key in ("", "''", "[a, b]"):  # vLLM would take None, '' or two keys
        said = refusal("--config", config_file(f"host: 0.0.0.0\n{spelling}: {not_one_key}\n"))
        assert "api-key: give one key" in said, said
    said = refusal("--config", config_file(f"host: 0.0.0.0\n{spelling}: []\n"))  # vLLM leaves an empty list out
    assert "(host: 0.0.0.0): without an API key" in said, said


def test_the_command_line_overrides_the_config_file_as_in_vllm(config_file):
    command, _ = serve("--config", config_file("host: 0.0.0.0\n"), "--host", "127.0.0.1")
    assert option(command, "--host") == "127.0.0.1"
    said = refusal("--config", config_file("host: 127.0.0.1\n"), "--host=0.0.0.0")
    assert said.startswith("lit-grpo serve --host 0.0.0.0: without an API key"), said
    # a unix socket in the file: no host added; the file's other options are not overridden by lit-grpo's
    command, _ = serve("--config", config_file("uds: /tmp/serve.sock\nenforce_eager: false\n"))
    assert "--host" not in command and "--enforce-eager" not in command
    # vLLM reads _ as - in an option's name, on the command line too
    command, environ = serve("--host", "0.0.0.0", "--api_key", KEY)
    assert environ[API_KEY_VARIABLE] == KEY and KEY not in command


def test_the_config_files_options_are_checked_as_the_command_lines(config_file):
    path = config_file("hos: 0.0.0.0\n")
    assert refusal("--config", path).startswith(f"lit-grpo serve --config {path}: --hos: vLLM would read it as --host")
    path = config_file("logprobs_mode: raw_logprobs\n")
    assert refusal("--config", path).startswith(f"lit-grpo serve --config {path} (logprobs-mode: raw_logprobs): "
                                                "the trainer compares its log-probs")


def test_a_config_file_vllm_could_not_read_is_one_line_naming_it(config_file, tmp_path):
    missing = str(tmp_path / "missing.yaml")
    assert refusal("--config", missing) == f"lit-grpo serve --config {missing}: cannot read it (No such file or directory)"
    broken = config_file("host: [0.0.0.0\n")
    assert refusal("--config", broken).startswith(f"lit-grpo serve --config {broken}: not valid YAML at line 2")
    listed = config_file("- host\n- 0.0.0.0\n")
    assert refusal("--config", listed).startswith(f"lit-grpo serve --config {listed}: vLLM needs a mapping of its options")
    assert refusal("--config", config_file("")).endswith("not an empty file")
    json_file = config_file("{}", name="serve.json")
    assert refusal("--config", json_file) == f"lit-grpo serve --config {json_file}: vLLM reads only a .yaml or .yml config file"
    path = config_file("host: 0.0.0.0\n")
    assert refusal(f"--config={path}").startswith(f"lit-grpo serve --config={path}: vLLM reads a config file only from "
                                                  "--config FILE")
    assert refusal("--config", path, "--config", path) == "lit-grpo serve --config: give one config file (vLLM reads only one)"
    assert refusal("--config").startswith("lit-grpo serve --config: give the YAML file")
    assert refusal("--conf", path).startswith("lit-grpo serve --conf: vLLM would read it as --config")


def test_vllms_own_parser_reads_the_host_and_key_lit_grpo_checked(config_file):
    """Where vLLM is installed (its parser only; no engine starts): the command ``lit-grpo serve`` builds, parsed
    as vLLM's server parses it, binds the host and asks for the key lit-grpo checked."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        if os.environ.get("LIT_GRPO_REQUIRE_VLLM") == "1":
            raise
        pytest.skip("vLLM is not installed")
    cases = [(["--config", config_file(f"host: 0.0.0.0\napi_key: {KEY}\n", "keyed.yaml")], "0.0.0.0", KEY),
             (["--config", config_file("host: 0.0.0.0\nport: 8011\n", "open.yaml"), "--host", "::1"], "::1", None),
             (["--config", config_file("port: 8011\n", "port.yaml")], "127.0.0.1", None)]
    for words, host, key in cases:
        command, environ = serve(*words)
        parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])  # after python -m MODULE
        assert (parsed.host, environ.get(API_KEY_VARIABLE)) == (host, key)
        assert parsed.api_key == ([key] if key else None)
