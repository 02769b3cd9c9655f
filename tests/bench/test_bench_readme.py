"""bench/results/ holds what bench/README.md cites, and nothing else: every results file is named there,
and every ``bench/results/...`` path the READMEs name exists (superseded files, removed, are cited as
*git history*, without the path). The GPU check's files are written only where a GPU ran it."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
CITED_PATH = re.compile(r"(?<!:)bench/results/(\w+)\.(md|json|\{json,md\})")


def prose(path: Path) -> str:
    return re.sub(r"\s*\n\s*", " ", path.read_text())  # names wrapped across lines join up


def test_every_results_file_is_cited_in_bench_readme():
    text = prose(REPO / "bench" / "README.md")
    stems = {path.name.rsplit(".", 1)[0] for path in RESULTS.iterdir()}
    uncited = sorted(
        stem for stem in stems if not stem.startswith("gpu_check_") and not re.search(rf"(?<!\w){re.escape(stem)}(?!\w)", text)
    )
    assert uncited == [], f"bench/results/ files that bench/README.md does not cite: {uncited}"


def test_every_cited_results_path_exists():
    missing = []
    for readme in (REPO / "README.md", REPO / "bench" / "README.md"):
        for stem, ext in CITED_PATH.findall(prose(readme)):
            if stem.startswith("gpu_check_"):
                continue
            for suffix in ("md", "json") if ext == "{json,md}" else (ext,):
                if not (RESULTS / f"{stem}.{suffix}").exists():
                    missing.append(f"{readme.name}: bench/results/{stem}.{suffix}")
    assert missing == []
