"""The math recipes' correctness reward, and math_accuracy, against 676 labelled completions of
GSM-style problems (tests/rewards/fixtures/gsm_answer_forms.jsonl, written by the script beside it
from reasoning-gym's problems): each must agree with the labels on at least 99 % of them, and every
completion it scores otherwise is listed here with the reason."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest
import yaml

from lit_grpo import plugins
from lit_grpo.scoring import RewardScorer, build_reward

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).with_name("fixtures")
ROWS = [json.loads(line) for line in (FIXTURES / "gsm_answer_forms.jsonl").read_text().splitlines()]
GSM8K_RECIPES = ["qwen2.5-0.5b-gsm8k.yaml", "qwen2.5-7b-gsm8k-fsdp.yaml"]

# Every completion a reward is known to score against its label: id -> why. Adding one needs a
# reason a person would accept; the agreement must stay >= 99 % all the same.
KNOWN_MISSES: dict[str, dict[str, str]] = {
    "numeric_accuracy": {},
    "math_accuracy": {},
}


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.delenv("LIT_GRPO_PLUGINS", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def recipe_rewards(recipe: str) -> list[dict]:
    return yaml.safe_load((REPO / "configs" / recipe).read_text())["model"]["rewards"]


def misses(reward, rows=ROWS) -> list[dict]:
    """The rows whose score is not their label, with what the reward gave."""
    scores = reward(prompts=[row["question"] for row in rows], completions=[row["completion"] for row in rows],
                    completion_ids=[[0]] * len(rows), answer=[row["answer"] for row in rows])
    return [dict(row, score=score) for row, score in zip(rows, scores) if score != row["label"]]


def describe(missed: list[dict]) -> str:
    return "\n".join(
        f"  {row['id']} [{row['form']}] label {row['label']}, scored {row['score']}: "
        f"...{row['completion'][-80:]!r} vs gold ...{str(row['answer'])[-30:]!r}"
        for row in missed
    )


def check_agreement(name: str, missed: list[dict]) -> None:
    agreement = 1 - len(missed) / len(ROWS)
    listing = describe(missed)
    print(f"{name}: agrees with {len(ROWS) - len(missed)} of {len(ROWS)} labels ({agreement:.1%}); misses:\n{listing or '  none'}")
    assert agreement >= 0.99, f"{name} agrees with {agreement:.1%} of the labels; it misses:\n{listing}"
    assert {row["id"] for row in missed} == set(KNOWN_MISSES[name]), f"{name}'s misses changed; now:\n{listing}"


@pytest.mark.parametrize("recipe", GSM8K_RECIPES)
def test_the_recipe_correctness_reward_agrees_with_the_labels(recipe):
    correctness = recipe_rewards(recipe)[0]
    assert correctness["name"] == "numeric_accuracy", "the first reward of a GSM8K recipe checks the answer"
    reward = build_reward(correctness["name"], correctness.get("args") or {})
    check_agreement("numeric_accuracy", misses(reward))


def test_math_accuracy_agrees_with_the_labels():
    check_agreement("math_accuracy", misses(build_reward("math_accuracy", {})))


def test_the_set_holds_every_form_of_the_issue_labelled_both_ways():
    forms = collections.Counter()
    for row in ROWS:
        rendering, _, layout = row["form"].partition(" / ")
        forms[(rendering.removeprefix("wrong: "), row["label"])] += 1
        forms[(layout, row["label"])] += 1
    right = {rendering for rendering, label in forms if label == 1.0}
    for form in [
        "plain", "trailing .0", "trailing .00", "trailing zero", "trailing period", "thousands separator", "currency",
        "currency with cents", "unit", "sentence", "bold", "boxed", "inline latex \\(", "inline latex $",
        "display latex \\[", "latex unit", "latex thousands {,}", "latex thousands \\,", "latex dollar", "hashes",
        "the answer is", "final answer boxed", "answer colon", "negative currency", "unicode minus", "percent",
        "latex percent", "slash fraction", "latex fraction", "latex dfrac", "boxed fraction",
        # where the answer stands
        "answer block", "answer block, one line", "answer block after prose naming the tag",
        "answer block after prose naming both tags", "gsm8k hashes", "after reasoning: the answer is",
        "after reasoning: boxed", "after reasoning: bold answer", "bare", "gsm8k solution", "boxed after the reasoning",
        "revised answer block, right last", "a guess in the reasoning, then the answer block",
        # read as a careful grader reads them (issue 49)
        "negated, then the answer: not X but Y", "corrected after the answer, right last",
        "checked after the answer, not corrected",
    ]:
        assert form in right, f"no right answer written as {form!r}"
    wrong = {rendering for rendering, label in forms if label == 0.0}
    for form in ["cut off in the reasoning", "cut off in the reasoning, no tags", "cut off inside the answer block",
                 "revised boxed, wrong last", "plain", "hashes", "boxed", "currency", "unit", "the answer is",
                 "cut off mid-sentence after the number", "negated: the answer is not",
                 "corrected after the answer, wrong last"]:
        assert form in wrong, f"no wrong or missing answer written as {form!r}"
    assert sum(label == 1.0 for _, label in forms.elements()) > 0 and len(ROWS) >= 300
    # the gold column as data sets write it: GSM8K's worked solution, "#### 8.0", bare values, JSON numbers
    golds = [row["answer"] for row in ROWS]
    assert any(isinstance(gold, int) for gold in golds)
    assert any(isinstance(gold, str) and re.search(r"#### -?\d+\.0$", gold) for gold in golds)
    assert any(isinstance(gold, str) and re.search(r"#### \d{1,3}(,\d{3})+$", gold) for gold in golds)
    assert any(isinstance(gold, str) and "\n" in gold and gold.rstrip().split("\n")[-1].startswith("####") for gold in golds)
    assert any(isinstance(gold, str) and "\\frac" in gold for gold in golds)
    # cut-off completions whose last number is the gold's: reading the last number scores them 1
    assert any(row["form"].startswith("cut off in the reasoning") and str(row["answer"]).endswith(
        re.findall(r"-?\d[\d,]*(?:\.\d+)?", row["completion"])[-1]) for row in ROWS)


def test_the_set_is_what_its_script_writes(tmp_path):
    pytest.importorskip("reasoning_gym", reason='the test extra installs it: pip install -e ".[test]"')
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_gsm_answer_forms", FIXTURES / "make_gsm_answer_forms.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.write_rows()
    assert rows == ROWS, "the script no longer writes the committed set: run it, and read the diff"


@pytest.mark.parametrize("recipe", GSM8K_RECIPES)
def test_the_recipe_system_prompt_and_its_rewards_agree_on_the_format(recipe):
    """The system prompt's own example, filled in with a worked answer, scores 1 on each reward; the
    format is scored apart from the answer, at weight 0.2."""
    config = yaml.safe_load((REPO / "configs" / recipe).read_text())
    prompt = config["data"]["system_prompt"]
    example = re.search(r"<think>[^<]*</think>\s*<answer>[^<]*</answer>", prompt).group()  # its "i.e." example
    completion = example.replace("reasoning process here", "48 / 2 = 24 in May, 48 + 24 = 72 in all.").replace(
        "answer here", "72"
    )
    assert completion != example
    specs = recipe_rewards(recipe)
    assert [(spec["name"], spec["weight"]) for spec in specs] == [("numeric_accuracy", 1.0), ("think_format", 0.2)]
    scorer = RewardScorer(specs)
    try:
        gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
        wrong_value = completion.replace(">72<", ">71<").replace(" 72 ", " 71 ")
        no_tags = "48 / 2 = 24 in May, 48 + 24 = 72 in all.\n#### 72"
        scores = scorer(["q"] * 3, [completion, wrong_value, no_tags], [[1]] * 3, {"answer": [gold] * 3})
        assert scores.tolist() == [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]]  # (correct, format) each
    finally:
        scorer.close()
