"""Shared pytest fixtures. Tests run on CPU without network access."""

import os

# Never reach for the Hugging Face Hub: fail fast instead of hanging on a network that is not there.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Tests are grouped in folders that mirror lit_grpo's packages; a test module may import another's helpers
# by its name (``from test_module import make_module``) wherever the two live, as when they were side by side.
TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(folder) for folder in sorted(TESTS.iterdir())
                if folder.is_dir() and any(folder.glob("test_*.py")) and str(folder) not in sys.path]

from marked_tests import EVERY_TEST, INTEGRATION, SLOW  # noqa: E402  (tests/marked_tests.py)

from lit_grpo.tiny import build_tiny_model  # noqa: E402

# Lightning's loggers get their stream handler when lightning is first imported: import it now, while
# stderr is the real one, not inside a test whose captured stderr is closed when it ends ("--- Logging
# error ---" in the next test that runs the command in this process, whichever order tests run in).
import lightning.pytorch  # noqa: E402, F401


def pytest_collection_modifyitems(config, items):
    """Mark the tests that tests/marked_tests.py names ``integration`` or ``slow``; this hook runs
    before ``-m`` selects, so ``pytest -m "not slow"`` leaves them out."""
    for item in items:
        try:
            path = item.path.relative_to(config.rootpath).as_posix()
        except ValueError:  # a test file outside the repository
            continue
        function = getattr(item, "originalname", item.name)  # every parametrization of it
        for marker, tests_by_file in (("integration", INTEGRATION), ("slow", SLOW)):
            named = tests_by_file.get(path, ())
            if named == EVERY_TEST or function in named:
                item.add_marker(marker)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama model with a character-level tokenizer and a ``<pad>`` token, built once."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_dir_no_pad(tmp_path_factory):
    """Like ``tiny_model_dir`` but without a pad token (``tokenizer.pad_token is None``)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-no-pad"), pad_token=False)


# --------------------------------------------------------------------------------------------------
# Fixtures for the training tests (test_module.py, test_cli.py, test_bad_input.py)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def write_jsonl(tmp_path):
    """``write_jsonl(rows, name="prompts.jsonl") -> path``: a small JSON-lines data file in tmp_path."""
    import json

    def write(rows, name="prompts.jsonl"):
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    return write


@pytest.fixture
def say_a_or_b_file(write_jsonl):
    """The quickstart task: 16 prompts "Say a:" / "Say b:" with the character in a ``target`` column."""
    return write_jsonl([{"prompt": f"Say {c}:", "target": c} for c in "ab" * 8])


def cpu_trainer(**overrides):
    """A Lightning Trainer on CPU without logger, bars or checkpoints (1 step unless overridden);
    a plain function too, for module-scoped fixtures that cannot use ``fast_trainer``."""
    import lightning.pytorch as pl

    kwargs = dict(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def set_hparams(module, **hparams):
    """Change ``model.*`` settings of a constructed module: in ``module.hparams``, then in the setting
    records it runs with (``module.apply_settings()``, ``lit_grpo.settings.RunSettings``)."""
    for name, value in hparams.items():
        setattr(module.hparams, name, value)
    module.apply_settings()


def logps_entropy_grads(module, rollout, **hparams):
    """With ``module.hparams`` updated by ``hparams``: the rollout's log-probs and entropy ``[n, C]``
    and the gradient (all policy parameters, flattened) of their masked sum."""
    import torch

    set_hparams(module, **hparams)
    module.policy.zero_grad()
    logps, entropy = module.logprobs.completion_logps(module.policy, rollout, with_entropy=True)
    mask = rollout.completion_mask[:, : logps.size(1)]
    ((logps * mask).sum() + (entropy * mask).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    return logps.detach(), entropy.detach(), grads


@pytest.fixture
def fresh_cli(monkeypatch):
    """The ``lit-grpo`` command as a user starts it: no arguments of pytest's in ``sys.argv`` (which
    LightningCLI would warn about), no plugin filter or traceback switch from the environment, and
    plugins discovered afresh."""
    import sys

    from lit_grpo import plugins

    monkeypatch.setattr(sys, "argv", ["lit-grpo"])
    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    monkeypatch.delenv("LIT_GRPO_TRACEBACK", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


@pytest.fixture
def fast_trainer():
    """``fast_trainer(**overrides) -> lightning Trainer``: :func:`cpu_trainer`."""
    return cpu_trainer


@pytest.fixture
def reward_plugin(monkeypatch):
    """``reward_plugin(name=fn, ...)`` registers rewards under those names for one test.

    They are registered with ``lit_grpo.plugins.register_plugin`` as a plugin module attributed to the
    package ``test-rewards``; the registry is reset before and after the test.
    """
    from lit_grpo import plugins

    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    plugins.reset_plugins()
    registered = []

    def register(**rewards):
        registered.append(plugins.register_functions("test-rewards", rewards))
        return registered[-1]

    yield register
    for module in registered:
        plugins.unregister_plugin(module)
    plugins.reset_plugins()


@pytest.fixture(scope="module")
def chaotic_model(tiny_model_dir):
    """The tiny model with large random weights: greedy decoding then varies from token to token
    (the plain tiny model repeats one token), so completions end at many different steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A tiny random ``Qwen2ForCausalLM`` shaped like Qwen2.5-Instruct (ChatML chat template, EOS ids
    ``<|im_end|>`` and ``<|endoftext|>``), saved in bf16 as hub checkpoints are; 2048 positions, as a
    one-character-a-token prompt with a tool's schema takes about 800."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), architecture="qwen2", dtype="bfloat16",
                            max_position_embeddings=2048)  # room for prompts with tools' schemas


# A few rows in GSM8K's format (`question`; `answer`: the worked solution, then "#### <number>").
GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
        "$<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write "
        "a year?",
        "answer": "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 pages every "
        "week\nThat means he writes 12*52=<<12*52=624>>624 pages a year\n#### 624",
    },
    {
        "question": "Albert buys 2 large pizzas and 2 small pizzas. A large pizza has 16 slices and a small pizza "
        "has 8 slices. If he eats it all, how many pieces does he eat that day?",
        "answer": "He eats 32 from the largest pizzas because 2 x 16 = <<2*16=32>>32\nHe eats 16 from the small "
        "pizza because 2 x 8 = <<2*8=16>>16\nHe eats 48 pieces because 32 + 16 = <<32+16=48>>48\n#### 48",
    },
]


@pytest.fixture
def gsm8k_file(write_jsonl):
    """``gsm8k_file(copies=8) -> path``: GSM8K-format rows (``question``, ``answer``), repeated."""

    def write(copies: int = 8):
        return write_jsonl(GSM8K_ROWS * copies, name="gsm8k.jsonl")

    return write


# examples/environment-plugin's warm start of a tiny tool-calling model, as the tests train it
WARM_TOOL_MODEL_ARGS = ["--steps", "150", "--short-steps", "50", "--call-frac", "1", "--hidden-size", "64"]
KV_LOOKUP = TESTS.parent / "examples" / "environment-plugin"


def cached_warm_tool_model(config: pytest.Config, target: Path) -> Path:
    """The warm-started tool model at ``target``, copied from pytest's cache (``.pytest_cache``), where it is
    trained once for every session: the README's test block and its vLLM block share one (about 25 s of
    training on 2 cores). The cache's key is the warm start's arguments and the source of the files that
    make it, so a changed warm start trains anew; each session gets a copy of its own."""
    import contextlib
    import hashlib
    import shutil
    import subprocess

    sources = [KV_LOOKUP / "lit_grpo_kv_lookup" / "warm_start.py", KV_LOOKUP / "lit_grpo_kv_lookup" / "__init__.py",
               TESTS.parent / "lit_grpo" / "tiny.py", TESTS.parent / "lit_grpo" / "models.py"]
    digest = hashlib.sha256(" ".join(WARM_TOOL_MODEL_ARGS).encode())
    for source in sources:
        digest.update(source.read_bytes())
    name = f"warm-tool-model-{digest.hexdigest()[:16]}"
    cache = getattr(config, "cache", None)  # none under -p no:cacheprovider: the model is this session's
    cached = cache.mkdir(name) if cache is not None else target / name
    if not (cached / "model.safetensors").exists():
        # a subprocess: the vLLM environment has the example on PYTHONPATH only; trained beside the cache, in a
        # directory of this process's own (two sessions at once each train one), then renamed into place
        partial = cached.with_name(f"{cached.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(KV_LOOKUP), os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-m", "lit_grpo_kv_lookup.warm_start", str(partial), *WARM_TOOL_MODEL_ARGS],
                       env=env, check=True, capture_output=True, timeout=900)
        try:
            with contextlib.suppress(FileNotFoundError):  # none under -p no:cacheprovider
                cached.rmdir()  # the empty directory that cache.mkdir made: one another session filled stays
            partial.rename(cached)
        except OSError:  # another session's model got there first: the same training, so it is used
            shutil.rmtree(partial, ignore_errors=True)
    if cache is None:
        return cached
    shutil.copytree(cached, target, dirs_exist_ok=True)
    return target


@pytest.fixture(scope="session")
def warm_tool_model(request, tmp_path_factory):
    """examples/environment-plugin's warm-started tiny Qwen2 model (briefly trained on lookup
    transcripts): it calls the `lookup` tool, so its rollouts are multi-turn."""
    pytest.importorskip("lit_grpo_kv_lookup", reason="pip install -e examples/environment-plugin (README: Tests)")
    return cached_warm_tool_model(request.config, tmp_path_factory.mktemp("tiny-kv-model"))
