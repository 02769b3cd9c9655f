"""Reward plugin discovery and the reward registry (lit_grpo.plugins).

Real discovery uses the installed distributions ``lit-grpo-rewards`` (``pip install -e rewards``) and
``lit-grpo-test-plugin`` (``pip install -e tests/plugin_pkg``). Everything else fakes the entry-point
lookup with fake distributions, the way pytest's testing/test_config.py does.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import sys
import types
import warnings

import pytest

import lit_grpo
from lit_grpo import plugins
from lit_grpo.cli import format_rewards_table, rewards_as_json
from lit_grpo.plugins import (
    DuplicateRewardError,
    PluginError,
    PluginLoadWarning,
    RewardArgumentError,
    RegistryEntry,
    UnknownRewardError,
)
from lit_grpo.scoring import build_reward

TEST_PLUGIN_VERSION = importlib.metadata.version("lit-grpo-test-plugin")
REWARDS_VERSION = importlib.metadata.version("lit-grpo-rewards")


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    monkeypatch.delenv("LIT_GRPO_STRICT_PLUGINS", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


# --------------------------------------------------------------------------------------------------
# Fake distributions
# --------------------------------------------------------------------------------------------------


class FakeDist:
    def __init__(self, name: str, version: str):
        self.name = name
        self.version = version
        self.metadata = {"Name": name}


class FakeEntryPoint:
    group = "lit_grpo"

    def __init__(self, name: str, value: str, dist: FakeDist, loader=None):
        self.name = name
        self.value = value
        self.dist = dist
        self._loader = loader
        self.loaded = 0

    def load(self):
        self.loaded += 1
        if self._loader is not None:
            return self._loader()
        return importlib.import_module(self.value)


def make_plugin(module_name: str, **rewards) -> types.ModuleType:
    """A plugin module whose register_rewards registers each reward under its keyword name."""
    module = types.ModuleType(module_name)

    @lit_grpo.hookimpl
    def register_rewards(register):
        for name, obj in rewards.items():
            register(obj, name=name)

    module.register_rewards = register_rewards
    return module


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace the installed entry points with fake ones: ``fake_entry_points(ep, ...)``."""

    def install(*eps):
        calls = []

        def entry_points(**kwargs):
            calls.append(kwargs)
            return [ep for ep in eps if kwargs.get("group") in (None, ep.group)]

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
        return calls

    return install


def fake_plugin(monkeypatch, ep_name, dist_name, version, **rewards) -> FakeEntryPoint:
    module_name = f"fake_{ep_name}"
    monkeypatch.setitem(sys.modules, module_name, make_plugin(module_name, **rewards))
    return FakeEntryPoint(ep_name, module_name, FakeDist(dist_name, version))


def reward_a(prompts, completions, **kwargs):
    """Scores A."""
    return [1.0] * len(completions)


def reward_b(prompts, completions, **kwargs):
    """Scores B."""
    return [0.0] * len(completions)


# --------------------------------------------------------------------------------------------------
# Real entry points
# --------------------------------------------------------------------------------------------------


def test_real_entry_points_attribute_rewards_to_their_distributions():
    import lit_grpo_rewards
    import lit_grpo_test_plugin

    rewards = plugins.get_rewards()

    shouts = rewards["shouts"]
    assert shouts.obj is lit_grpo_test_plugin.shouts
    assert (shouts.package, shouts.version) == ("lit-grpo-test-plugin", TEST_PLUGIN_VERSION)
    assert TEST_PLUGIN_VERSION == "0.0.1"
    assert shouts.doc == "1.0 if the completion is all upper case, else 0.0."
    assert shouts.kind == "function"

    contains = rewards["contains_word"]  # registered with an explicit name
    assert contains.obj is lit_grpo_test_plugin.ContainsWord
    assert contains.kind == "class"
    assert contains.doc == "1.0 if the completion contains `word`, else 0.0."

    for name in ("char_fraction", "exact_match", "think_format"):
        info = rewards[name]
        assert (info.package, info.version) == ("lit-grpo-rewards", REWARDS_VERSION)
        assert info.obj is getattr(lit_grpo_rewards, name)

    assert list(rewards) == sorted(rewards)


def test_get_plugins_lists_packages_with_their_rewards():
    by_package = {p.package: p for p in plugins.get_plugins()}
    test_plugin = by_package["lit-grpo-test-plugin"]
    assert test_plugin.name == "lit_grpo_test_plugin"
    assert test_plugin.version == TEST_PLUGIN_VERSION
    assert test_plugin.rewards == ["contains_word", "shouts"]
    assert test_plugin.error is None
    first_party = by_package["lit-grpo-rewards"].rewards  # the list grows; these must stay
    assert {"char_fraction", "exact_match", "think_format"} <= set(first_party)
    assert first_party == sorted(first_party)


def test_real_entry_points_restricted_by_distribution_name(monkeypatch):
    monkeypatch.setenv("LIT_GRPO_PLUGINS", "lit-grpo-test-plugin")
    rewards = plugins.get_rewards()
    assert set(rewards) == {"shouts", "contains_word"}


def test_loading_is_lazy_and_done_once(monkeypatch):
    real = importlib.metadata.entry_points
    calls = []

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", counting)
    assert calls == []  # nothing happens at import or reset time
    plugins.get_rewards()
    plugins.get_reward("shouts")
    build_reward("shouts")
    assert calls == [{"group": "lit_grpo"}]
    plugins.reset_plugins()
    plugins.get_rewards()
    assert len(calls) == 2


# --------------------------------------------------------------------------------------------------
# Fake distributions
# --------------------------------------------------------------------------------------------------


def test_fake_distribution_name_and_version_recorded(monkeypatch, fake_entry_points):
    fake_entry_points(fake_plugin(monkeypatch, "alpha", "alpha-rewards", "3.1.4", score_a=reward_a))
    rewards = plugins.get_rewards()
    assert list(rewards) == ["score_a"]  # the real installed plugins are hidden by the fake lookup
    info = rewards["score_a"]
    assert (info.name, info.package, info.version, info.doc) == ("score_a", "alpha-rewards", "3.1.4", "Scores A.")


def test_env_var_restricts_by_entry_point_or_distribution_name(monkeypatch, fake_entry_points):
    a = fake_plugin(monkeypatch, "alpha", "alpha-rewards", "1.0", score_a=reward_a)
    b = fake_plugin(monkeypatch, "beta", "beta-rewards", "1.0", score_b=reward_b)
    c = fake_plugin(monkeypatch, "gamma", "gamma-rewards", "1.0", score_c=reward_a)
    fake_entry_points(a, b, c)
    # entry-point name for alpha, distribution name (with '_' for '-', any case) for beta
    monkeypatch.setenv("LIT_GRPO_PLUGINS", " alpha , Beta_Rewards")
    assert set(plugins.get_rewards()) == {"score_a", "score_b"}
    assert (a.loaded, b.loaded, c.loaded) == (1, 1, 0)  # gamma is never imported


def test_env_var_empty_loads_everything(monkeypatch, fake_entry_points):
    a = fake_plugin(monkeypatch, "alpha", "alpha-rewards", "1.0", score_a=reward_a)
    b = fake_plugin(monkeypatch, "beta", "beta-rewards", "1.0", score_b=reward_b)
    fake_entry_points(a, b)
    monkeypatch.setenv("LIT_GRPO_PLUGINS", " , ")
    assert set(plugins.get_rewards()) == {"score_a", "score_b"}


def test_env_var_naming_an_absent_plugin_warns(monkeypatch, fake_entry_points):
    fake_entry_points(fake_plugin(monkeypatch, "alpha", "alpha-rewards", "1.0", score_a=reward_a))
    monkeypatch.setenv("LIT_GRPO_PLUGINS", "alpha,nope")
    with pytest.warns(PluginLoadWarning, match=r"'nope' but no installed lit-grpo plugin package matches; installed: alpha \(alpha-rewards\)"):
        assert set(plugins.get_rewards()) == {"score_a"}


def _broken_loader():
    raise ImportError("No module named 'torchvision'")


def test_failing_import_is_reported_and_others_still_load(monkeypatch, fake_entry_points):
    good = fake_plugin(monkeypatch, "alpha", "alpha-rewards", "1.0", score_a=reward_a)
    broken = FakeEntryPoint("broken", "broken_mod", FakeDist("broken-dist", "2.0"), loader=_broken_loader)
    fake_entry_points(broken, good)
    with pytest.warns(PluginLoadWarning) as record:
        rewards = plugins.get_rewards()
    assert set(rewards) == {"score_a"}
    (warning,) = [w for w in record if issubclass(w.category, PluginLoadWarning)]
    message = str(warning.message)
    assert "'broken = broken_mod'" in message
    assert "broken-dist 2.0" in message
    assert "ImportError: No module named 'torchvision'" in message
    assert "LIT_GRPO_STRICT_PLUGINS=1" in message
    # the failure is remembered, not retried or re-warned on every lookup
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugins.get_rewards()
    assert broken.loaded == 1
    failed = [p for p in plugins.get_plugins() if p.error]
    assert [(p.name, p.package, p.version) for p in failed] == [("broken", "broken-dist", "2.0")]
    # ... and an unknown-reward error mentions it, since it may be why the reward is missing
    with pytest.raises(UnknownRewardError, match="failed to load.*broken-dist 2.0"):
        plugins.get_reward("from_broken")


@pytest.mark.parametrize("how", ["env", "argument"])
def test_strict_mode_makes_a_failing_import_an_error(monkeypatch, fake_entry_points, how):
    good = fake_plugin(monkeypatch, "alpha", "alpha-rewards", "1.0", score_a=reward_a)
    broken = FakeEntryPoint("broken", "broken_mod", FakeDist("broken-dist", "2.0"), loader=_broken_loader)
    fake_entry_points(good, broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict mode raises instead of warning
        with pytest.raises(PluginError, match=r"strict mode") as excinfo:
            if how == "env":
                monkeypatch.setenv("LIT_GRPO_STRICT_PLUGINS", "1")
                plugins.get_rewards()
            else:
                plugins.load_plugins(strict=True)
    assert "'broken = broken_mod'" in str(excinfo.value)
    assert "broken-dist 2.0" in str(excinfo.value)
    assert "torchvision" in str(excinfo.value)


def test_hook_that_raises_is_reported_and_its_partial_registrations_dropped(monkeypatch, fake_entry_points):
    module = types.ModuleType("fake_half")

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(reward_a, name="half_registered")
        raise RuntimeError("config file missing")

    module.register_rewards = register_rewards
    monkeypatch.setitem(sys.modules, "fake_half", module)
    half = FakeEntryPoint("half", "fake_half", FakeDist("half-dist", "0.3"))
    fake_entry_points(half, fake_plugin(monkeypatch, "beta", "beta-rewards", "1.0", score_b=reward_b))
    with pytest.warns(PluginLoadWarning, match=r"half-dist 0\.3.*RuntimeError: config file missing"):
        rewards = plugins.get_rewards()
    assert set(rewards) == {"score_b"}


def test_unknown_hook_name_is_reported_with_a_suggestion(monkeypatch, fake_entry_points):
    module = types.ModuleType("fake_typo")

    @lit_grpo.hookimpl
    def register_reward(register):  # missing 's'
        register(reward_a)

    module.register_reward = register_reward
    monkeypatch.setitem(sys.modules, "fake_typo", module)
    fake_entry_points(FakeEntryPoint("typo", "fake_typo", FakeDist("typo-dist", "1.0")))
    with pytest.warns(PluginLoadWarning, match=r"typo-dist 1\.0 implements unknown hook\(s\) register_reward \(did you mean register_rewards\?\)"):
        assert plugins.get_rewards() == {}


def test_duplicate_reward_names_across_packages_name_both(monkeypatch, fake_entry_points):
    a = fake_plugin(monkeypatch, "alpha", "alpha-rewards", "1.0", accuracy=reward_a)
    b = fake_plugin(monkeypatch, "beta", "beta-rewards", "2.5", accuracy=reward_b)
    fake_entry_points(a, b)
    with pytest.raises(DuplicateRewardError) as excinfo:
        plugins.get_rewards()
    message = str(excinfo.value)
    assert "'accuracy'" in message
    assert "alpha-rewards 1.0" in message and "beta-rewards 2.5" in message
    assert "LIT_GRPO_PLUGINS" in message
    # not cached away: the next lookup fails the same way
    with pytest.raises(DuplicateRewardError):
        plugins.get_reward("accuracy")


def test_duplicate_with_a_real_plugin_via_direct_registration():
    plugins.register_plugin(make_plugin("my_local_rewards", shouts=reward_a))
    with pytest.raises(DuplicateRewardError, match=r"'shouts'.*lit-grpo-test-plugin 0\.0\.1.*my_local_rewards"):
        plugins.get_rewards()


def test_same_package_registering_a_name_twice_is_an_error():
    module = types.ModuleType("twice_rewards")

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(reward_a, name="twice")
        register(reward_b, name="twice")

    module.register_rewards = register_rewards
    plugins.register_plugin(module)
    with pytest.raises(DuplicateRewardError, match="'twice' is registered twice by plugin package twice_rewards"):
        plugins.get_rewards()


def test_register_defaults_name_and_rejects_non_callables(monkeypatch, fake_entry_points):
    class MyClassReward:
        """A class reward."""

        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    module = types.ModuleType("defaults_mod")

    @lit_grpo.hookimpl
    def register_rewards(register):
        register(reward_a)
        register(MyClassReward)

    module.register_rewards = register_rewards
    bad = types.ModuleType("bad_mod")

    @lit_grpo.hookimpl
    def bad_register(register):
        register(reward_b, name="good_before_bad")
        register("not a function", name="oops")

    bad.register_rewards = bad_register
    fake_entry_points()
    plugins.register_plugin(module)
    with pytest.warns(PluginLoadWarning, match=r"bad_mod.*'not a function', which is not callable"):
        plugins.register_plugin(bad)
        rewards = plugins.get_rewards()
    assert set(rewards) == {"reward_a", "MyClassReward"}  # nothing from the broken plugin
    assert rewards["MyClassReward"].doc == "A class reward."


def test_direct_registration_uses_module_name_and_empty_version(fake_entry_points):
    fake_entry_points()
    module = make_plugin("my_local_rewards", local_reward=reward_a)
    plugins.register_plugin(module)
    info = plugins.get_reward("local_reward")
    assert (info.package, info.version) == ("my_local_rewards", "")
    assert info.label == "my_local_rewards"
    plugins.unregister_plugin(module)
    with pytest.raises(UnknownRewardError):
        plugins.get_reward("local_reward")


def test_registering_on_the_plugin_manager_directly_is_seen(fake_entry_points):
    fake_entry_points()
    assert plugins.get_rewards() == {}
    pm = plugins.get_plugin_manager()
    assert isinstance(pm, lit_grpo.plugins.pluggy.PluginManager)
    pm.register(make_plugin("pm_direct", via_pm=reward_a))
    info = plugins.get_reward("via_pm")
    assert (info.package, info.version) == ("pm_direct", "")


# --------------------------------------------------------------------------------------------------
# Unknown rewards
# --------------------------------------------------------------------------------------------------


def test_unknown_reward_lists_installed_rewards_with_packages():
    with pytest.raises(UnknownRewardError) as excinfo:
        plugins.get_reward("shout")
    assert isinstance(excinfo.value, ValueError)
    message = str(excinfo.value)
    assert message.startswith("Unknown reward 'shout'. Did you mean 'shouts'?")
    assert f"shouts (lit-grpo-test-plugin {TEST_PLUGIN_VERSION})" in message
    assert f"contains_word (lit-grpo-test-plugin {TEST_PLUGIN_VERSION})" in message
    assert f"char_fraction (lit-grpo-rewards {REWARDS_VERSION})" in message
    assert "pip install lit-grpo-rewards" in message
    assert "lit-grpo rewards" in message


def test_unknown_reward_with_nothing_installed(fake_entry_points, monkeypatch):
    fake_entry_points()
    monkeypatch.setenv("LIT_GRPO_PLUGINS", "")
    with pytest.raises(UnknownRewardError, match=r"Unknown reward 'accuracy'\. No rewards are installed\. .*pip install"):
        plugins.get_reward("accuracy")


def test_unknown_reward_mentions_plugin_restriction(monkeypatch):
    monkeypatch.setenv("LIT_GRPO_PLUGINS", "lit_grpo_test_plugin")
    with pytest.raises(UnknownRewardError) as excinfo:
        build_reward("char_fraction")
    message = str(excinfo.value)
    assert "LIT_GRPO_PLUGINS='lit_grpo_test_plugin' restricts" in message
    assert "char_fraction (" not in message  # not loaded, so not listed


# --------------------------------------------------------------------------------------------------
# build_reward
# --------------------------------------------------------------------------------------------------


def test_build_class_reward_with_constructor_args():
    import lit_grpo_test_plugin

    reward = build_reward("contains_word", {"word": "cat"})
    assert isinstance(reward, lit_grpo_test_plugin.ContainsWord)
    assert reward.word == "cat"
    assert reward(prompts=["p", "p"], completions=["a cat", "a dog"], completion_ids=[[], []]) == [1.0, 0.0]


def test_build_function_without_args_returns_the_function_itself():
    import lit_grpo_test_plugin

    assert build_reward("shouts") is lit_grpo_test_plugin.shouts
    assert build_reward("shouts", {}) is lit_grpo_test_plugin.shouts


def test_build_function_with_args_binds_them_and_keeps_its_name(fake_entry_points):
    fake_entry_points()

    def scaled(completions, scale=1.0, **kwargs):
        """Scaled length."""
        return [scale * len(c) for c in completions]

    plugins.register_plugin(make_plugin("fn_rewards", scaled=scaled))
    reward = build_reward("scaled", {"scale": 0.5})
    assert isinstance(reward, functools.partial)
    assert reward.__name__ == "scaled"
    assert reward.__doc__ == "Scaled length."
    assert reward(prompts=["p"], completions=["abcd"], completion_ids=[[1]]) == [2.0]
    # a dataset column of the same name does not override the configured value
    assert reward(prompts=["p"], completions=["abcd"], completion_ids=[[1]], scale=[10.0]) == [2.0]


def test_build_function_with_unknown_arg_names_reward_and_argument(fake_entry_points):
    fake_entry_points()

    def strict_fn(prompts, completions, completion_ids, threshold=0.5):
        return [0.0] * len(completions)

    plugins.register_plugin(make_plugin("fn_rewards", strict_fn=strict_fn), version="9.9")
    with pytest.raises(RewardArgumentError) as excinfo:
        build_reward("strict_fn", {"treshold": 0.1})
    assert str(excinfo.value) == (
        "Reward 'strict_fn' (fn_rewards 9.9) got an unexpected argument 'treshold' in args "
        "(did you mean 'threshold'?); its function accepts: threshold"
    )


def test_build_function_with_var_kwargs_refuses_a_likely_typo(fake_entry_points):
    """**kwargs would swallow a misspelt argument (and the reward would ignore it): an error with the
    closest parameter; a name unlike any parameter still goes to **kwargs."""
    fake_entry_points()

    def loose(completions, threshold=0.5, **kwargs):
        return [0.0] * len(completions)

    plugins.register_plugin(make_plugin("fn_rewards", loose=loose))
    with pytest.raises(RewardArgumentError) as excinfo:
        build_reward("loose", {"treshold": 0.1})
    assert str(excinfo.value) == (
        "Reward 'loose' (fn_rewards) got an unexpected argument 'treshold' in args "
        "(did you mean 'threshold'?); its function accepts: threshold"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build_reward("loose", {"anything_else": 1}).keywords == {"anything_else": 1}  # for rewards that read it


def test_build_rejects_args_that_the_trainer_supplies():
    with pytest.raises(RewardArgumentError, match="args may not set 'completions'"):
        build_reward("shouts", {"completions": ["x"]})


def test_build_class_with_bad_args():
    with pytest.raises(RewardArgumentError, match=r"'contains_word' \(lit-grpo-test-plugin 0\.0\.1\) got an unexpected argument 'wrd' in args \(did you mean 'word'\?\); its constructor accepts: word"):
        build_reward("contains_word", {"wrd": "cat"})
    with pytest.raises(RewardArgumentError, match=r"'contains_word'.*cannot be constructed with args \{\}: missing a required argument: 'word'"):
        build_reward("contains_word")


def test_build_class_whose_constructor_raises_chains_the_cause():
    with pytest.raises(RewardArgumentError, match=r"constructing ContainsWord\(\*\*\{'word': ''\}\) raised ValueError: word must be a non-empty string") as excinfo:
        build_reward("contains_word", {"word": ""})
    assert isinstance(excinfo.value.__cause__, ValueError)


def test_build_rejects_non_mapping_args():
    with pytest.raises(RewardArgumentError, match="args must be a mapping.*got list"):
        build_reward("contains_word", ["cat"])


# --------------------------------------------------------------------------------------------------
# Listing
# --------------------------------------------------------------------------------------------------


def _infos():
    return [
        RegistryEntry("accuracy", reward_a, "acme-rewards", "1.2.0", "1.0 if correct, else 0.0."),
        RegistryEntry("len", reward_b, "x", "", "Length."),
    ]


def test_format_rewards_table_aligns_columns():
    table = format_rewards_table(_infos())
    lines = table.splitlines()
    assert lines == [
        "NAME      PACKAGE       VERSION  DESCRIPTION",
        "accuracy  acme-rewards  1.2.0    1.0 if correct, else 0.0.",
        "len       x                      Length.",
    ]
    # a dict (as get_rewards returns) works too
    assert format_rewards_table({i.name: i for i in _infos()}) == table


def test_format_rewards_table_of_installed_rewards():
    table = format_rewards_table(plugins.get_rewards())
    line = next(l for l in table.splitlines() if l.startswith("shouts "))
    assert line.split()[:3] == ["shouts", "lit-grpo-test-plugin", TEST_PLUGIN_VERSION]
    assert line.endswith("1.0 if the completion is all upper case, else 0.0.")


def test_format_rewards_table_empty():
    assert format_rewards_table([]).startswith("No rewards installed. Rewards come from plugin packages")


def test_rewards_as_json():
    data = json.loads(rewards_as_json(_infos()))
    assert data[0] == {
        "name": "accuracy",
        "package": "acme-rewards",
        "version": "1.2.0",
        "description": "1.0 if correct, else 0.0.",
        "kind": "function",
        "object": f"{__name__}:reward_a",
    }
    assert [d["name"] for d in data] == ["accuracy", "len"]
    installed = {d["name"]: d for d in json.loads(rewards_as_json(plugins.get_rewards()))}
    assert installed["contains_word"]["kind"] == "class"
    assert installed["contains_word"]["object"] == "lit_grpo_test_plugin:ContainsWord"
    assert installed["char_fraction"]["package"] == "lit-grpo-rewards"
    assert json.loads(rewards_as_json([])) == []


def test_doc_is_first_nonblank_docstring_line(fake_entry_points):
    fake_entry_points()

    def multi(completions, **kwargs):
        """

        First real line.

        More detail.
        """

    def nodoc(completions, **kwargs):
        return []

    plugins.register_plugin(make_plugin("doc_rewards", multi=multi, nodoc=nodoc))
    assert plugins.get_reward("multi").doc == "First real line."
    assert plugins.get_reward("nodoc").doc == ""
