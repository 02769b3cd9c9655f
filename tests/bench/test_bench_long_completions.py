"""``python -m bench.long_completions`` at toy size: both trainers and the floor run, each in its own
process, and the table has a row per length with the floor below both peaks; its pieces (the untied
model, the parameter count, the memory estimate and the guard that keeps a run from starting, the
table's ratios and growth) are checked against values worked out by hand."""

import json

import pytest

from bench import long_completions as bench
from bench.gpu_check import installed

TOY = ["--vocab-size", "300", "--hidden-size", "64", "--intermediate-size", "128", "--layers", "2"]


@pytest.mark.skipif(not installed("trl"), reason="TRL is the bench extra")
def test_both_trainers_and_the_floor_run_at_a_tiny_vocabulary(tmp_path):
    bench.main(["--lengths", "16", *TOY, "--out", str(tmp_path), "--name", "toy"])

    data = json.loads((tmp_path / "toy.json").read_text())
    lit_label = next(label for label in data["labels"] if label.startswith("lit-grpo "))
    assert data["labels"] == [lit_label, "trl", "floor"]
    [row] = data["rows"]
    assert row["completion_length"] == 16
    runs = row["runs"]
    for label in data["labels"]:
        assert runs[label]["completion_lengths"] == [16, 16, 16, 16], label  # 1 prompt x 4, exactly L tokens
        assert runs[label]["fixed_length"], label
    prompt_length = runs[lit_label]["prompt_lengths"][0]
    assert runs["floor"]["prompt_lengths"] == [prompt_length] * 4  # the floor's rows are the trainers'
    floor = runs["floor"]["peak_rss_gib"]
    assert 0 < floor < runs[lit_label]["peak_rss_gib"] and floor < runs["trl"]["peak_rss_gib"]

    text = (tmp_path / "toy.md").read_text()
    header = f"| completion tokens | floor | {lit_label} | TRL 1.16 | {lit_label} / TRL |"
    assert header in text
    ratio = runs[lit_label]["peak_rss_gib"] / runs["trl"]["peak_rss_gib"]
    assert f"| 16 | {floor:.2f} | {runs[lit_label]['peak_rss_gib']:.2f} | {runs['trl']['peak_rss_gib']:.2f} | {ratio:.2f} |" in text


def test_the_model_has_an_untied_head_and_the_counted_parameters(tmp_path):
    from transformers import AutoModelForCausalLM

    shape = bench.BodyShape(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_pretrained(bench.build_untied_model(tmp_path / "model", shape, 64))

    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not model.lm_head.weight.equal(model.model.embed_tokens.weight)
    assert sum(p.numel() for p in model.parameters()) == shape.num_parameters()
    # by hand: 2 x 300 x 64 (embedding, head) + 2 layers x (q 64x64+64, k and v 64x32+32 each, o 64x64,
    # MLP 3 x 64 x 128, two norms 2 x 64) + the final norm 64
    assert shape.num_parameters() == 2 * 300 * 64 + 2 * (4096 + 64 + 2 * (2048 + 32) + 4096 + 3 * 8192 + 128) + 64


def test_the_estimate_extrapolates_the_measured_peaks():
    # two points: the line through them, 10 % over (2 GiB at 1k, 4 GiB at 2k -> 8 GiB at 4k -> 8.8)
    assert bench.estimate_peak_gib({1024: 2.0, 2048: 4.0}, 4096, 100.0, 100.0) == pytest.approx(8.8)
    # the last two points count: 1 -> 2 -> 2.5 GiB at 1k, 2k, 4k is 0.25 GiB per 1k -> 3.5 at 8k, 3.85
    assert bench.estimate_peak_gib({1024: 1.0, 2048: 2.0, 4096: 2.5}, 8192, 0.0, 0.0) == pytest.approx(3.85)
    # one point: that peak plus the per-token growth for the tokens more
    assert bench.estimate_peak_gib({1024: 5.0}, 2048, 100.0, 0.001) == pytest.approx(5.0 + 1.024)
    # none: the first guess
    assert bench.estimate_peak_gib({}, 1000, 2.0, 0.003) == pytest.approx(5.0)


def test_the_first_guess_counts_the_logits_a_trainer_keeps():
    shape = bench.BodyShape()
    base, floor_per_token = bench.first_guess(shape, rows=4, logits_copies=0)
    _, trainer_per_token = bench.first_guess(shape, rows=4, logits_copies=2)
    assert base == pytest.approx(16 * shape.num_parameters() / 2**30 + 1.5)
    # two float32 rows of 151,936 logits for each of 4 completions: 4,861,952 bytes a token
    assert (trainer_per_token - floor_per_token) * 2**30 == pytest.approx(2 * 4 * 151_936 * 4)


def test_a_run_over_the_cap_or_the_free_memory_does_not_start(monkeypatch):
    monkeypatch.setattr(bench, "available_gib", lambda: 10.0)
    assert bench.skip_reason(13.0, 12.0, 2.0) == "skipped: estimated 13.0 GiB, over --max-gib 12"
    assert bench.skip_reason(9.0, 12.0, 2.0) == "skipped: estimated 9.0 GiB, 10.0 GiB available (keeping 2 for others)"
    assert bench.skip_reason(7.5, 12.0, 2.0) is None


def test_the_table_gives_ratios_growth_and_skipped_runs():
    def run(gib):
        return {"peak_rss_gib": gib, "fixed_length": True}

    rows = [
        {"completion_length": 1024, "runs": {"lit-grpo a": run(5.0), "trl": run(4.0), "floor": run(2.0)}},
        {"completion_length": 2048, "runs": {"lit-grpo a": run(9.0), "trl": run(4.5), "floor": run(2.5)}},
        {"completion_length": 4096, "runs": {"lit-grpo a": {"skipped": "skipped: estimated 19.0 GiB, over --max-gib 12"},
                                             "trl": run(5.5), "floor": run(3.5)}},
    ]
    table = bench.results_table(rows, ["lit-grpo a", "trl", "floor"]).splitlines()

    assert table[0] == "| completion tokens | floor | lit-grpo a | TRL 1.16 | lit-grpo a / TRL |"
    assert table[2] == "| 1,024 | 2.00 | 5.00 | 4.00 | 1.25 |"
    assert table[3] == "| 2,048 | 2.50 | 9.00 | 4.50 | 2.00 |"
    assert table[4] == "| 4,096 | 3.50 | skipped | 5.50 |  |"
    # per 1k tokens between the shortest and longest measured: floor 1.5 GiB over 3,072 tokens,
    # lit-grpo 4 GiB over 1,024 (its 4,096 was skipped), TRL 1.5 GiB over 3,072
    assert table[5] == "| GiB per 1k tokens | +0.49 | +3.91 | +0.49 |  |"


def test_measured_runs_of_earlier_results_are_kept_not_run_again(tmp_path, monkeypatch):
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"rows": [
        {"completion_length": 1024, "runs": {"trl": {"peak_rss_gib": 4.0, "fixed_length": True},
                                             "floor": {"skipped": "skipped: estimated 99.0 GiB, over --max-gib 12"}}},
    ]}))
    started = []
    monkeypatch.setattr(bench, "measure_one", lambda args, label, *rest: started.append(label) or {
        "peak_rss_gib": 2.0, "completion_lengths": [1024] * 4, "prompt_lengths": [6] * 4})
    monkeypatch.setattr(bench, "available_gib", lambda: 100.0)
    args = bench.parse_args(["--lengths", "1024", "--keep-measured", str(earlier)])

    rows = bench.run_lengths(args, bench.BodyShape(), "model", {"trl": None, "floor": None}, kept=bench.kept_runs(args.keep_measured))

    assert started == ["floor"]  # TRL's peak at 1,024 was measured; the skipped floor runs now
    assert rows[0]["runs"]["trl"] == {"peak_rss_gib": 4.0, "fixed_length": True, "kept_from": "earlier.json"}
    assert rows[0]["runs"]["floor"]["peak_rss_gib"] == 2.0
    assert "trl from `earlier.json`" in bench.markdown_report(args, bench.BodyShape(), ["trl", "floor"], rows, {
        "cpu": "a CPU", "cores": 2, "load_average": (0.0, 0.0, 0.0), "versions": {}}, "python -m bench.long_completions")


def test_no_new_runs_starts_no_process_and_says_so(monkeypatch):
    monkeypatch.setattr(bench, "measure_one", lambda *a: pytest.fail("a run was started"))
    args = bench.parse_args(["--lengths", "2048", "--no-new-runs", "--note", "2,048 tokens took 25 min here"])

    rows = bench.run_lengths(args, bench.BodyShape(), "model", {"trl": None})

    assert rows[0]["runs"]["trl"] == {"skipped": "not measured (--no-new-runs: only the kept runs)"}
    assert bench.results_table(rows, ["trl"]).splitlines()[2] == "| 2,048 | skipped |"
    report = bench.markdown_report(args, bench.BodyShape(), ["trl"], rows, {
        "cpu": "a CPU", "cores": 2, "load_average": (0.0, 0.0, 0.0), "versions": {}}, "python -m bench.long_completions")
    assert "- 2,048 tokens took 25 min here" in report


def test_a_full_logits_column_runs_lit_grpo_without_the_fused_head(monkeypatch):
    """``--lit-full-logits REV``: a column of its own (its label ends ``, full logits``) whose run asks
    the driver to refuse the output head (``RunSpec.lit_full_logits``); the plain column does not.
    Each measured run's step time goes to a table of its own."""
    specs = []
    monkeypatch.setattr(bench, "run_in_subprocess", lambda spec, timeout=None: specs.append(spec) or {
        "peak_rss_mib": 2048.0, "rss_before_training_mib": 1024.0, "process_seconds": 9.0,
        "steps": [{"seconds": 3.25, "phases": {}, "prompt_lengths": [6] * 4, "completion_lengths": [16] * 4}]})
    args = bench.parse_args(["--lengths", "16", "--lit-full-logits", "worktree"])
    labels = {"lit-grpo abc": None, "lit-grpo abc" + bench.FULL_LOGITS: None}

    rows = bench.run_lengths(args, bench.BodyShape(), "model", labels)

    assert [spec.lit_full_logits for spec in specs] == [False, True]
    assert bench.step_seconds_table(rows, list(labels)).splitlines()[2] == "| 16 | 3.2 | 3.2 |"
    rows[0]["runs"]["lit-grpo abc"]["phases"] = {"generate": 1.0, "train": 2.25}
    assert bench.step_seconds_table(rows, list(labels)).splitlines()[2] == "| 16 | 3.2 (train 2.2) | 3.2 |"
