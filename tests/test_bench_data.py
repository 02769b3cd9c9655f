"""bench/harness.py's long-prompt variant of the quickstart data (bench/compare_trl.py --long-prompts-at), and
bench/ablation.py's choice of variants."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from harness import QUICKSTART_DATA, long_prompt_data  # noqa: E402


def test_long_prompts_put_an_instruction_of_the_given_length_before_every_prompt(tmp_path):
    original = [json.loads(line) for line in QUICKSTART_DATA.read_text().splitlines()]
    for extra in (40, 300):  # shorter and longer than one copy of the instruction
        rows = [json.loads(line) for line in long_prompt_data(tmp_path, extra).read_text().splitlines()]
        assert len(rows) == len(original)
        instruction = rows[0]["prompt"][:extra]
        for row, before in zip(rows, original):
            assert row["prompt"] == instruction + before["prompt"]
            assert row["target"] == before["target"]
        assert len(set(instruction)) > 10  # text, not one repeated character


def test_ablation_runs_the_default_first_and_only_the_variants_asked_for():
    import ablation  # bench/, on the path above

    assert ablation.parse_args([]).variants == list(ablation.VARIANTS)
    args = ablation.parse_args(["--variants", "token budget 4096"])
    assert args.variants == ["default", "token budget 4096"]  # the reference every ratio is taken against
    assert ablation.VARIANTS["token budget 4096"] == {"forward_token_budget": 4096}
    with pytest.raises(SystemExit):  # argparse names the choices on stderr
        ablation.parse_args(["--variants", "token budget 9999"])
