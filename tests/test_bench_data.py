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


def test_the_floor_share_2x_would_need_follows_from_both_trainers_rates():
    import compare_trl  # bench/, on the path above

    # lit-grpo: 1000 tok/s at 40 % of its floor (0.4 ms of matmuls per token); TRL: 600 tok/s.
    # 2x TRL = 1200 tok/s = 0.833 ms per token, of which the 0.4 ms floor is 48 %.
    lit = {"percent_of_floor": 40.0, "tokens_per_second": 1000.0}
    trl = {"percent_of_floor": 30.0, "tokens_per_second": 600.0}
    assert compare_trl.percent_of_floor_needed(lit, trl) == pytest.approx(48.0)
    assert compare_trl.percent_of_floor_needed(lit, trl, goal=1.0) == pytest.approx(24.0)
    # with the same floor per token TRL runs at 0.4 ms / (1/600 s) = 24 % of it: 2x needs twice that
    assert compare_trl.percent_of_floor_needed(lit, trl) == pytest.approx(2 * 0.4e-3 * 600 * 100)
    # lit-grpo at 70 % of its floor, TRL at 0.7 ms / (1/900 s) = 63 %: 2x would need 126 %, beyond the machine
    lit = {"percent_of_floor": 70.0, "tokens_per_second": 1000.0}
    trl = {"percent_of_floor": 63.0, "tokens_per_second": 900.0}
    assert compare_trl.percent_of_floor_needed(lit, trl) == pytest.approx(126.0)
