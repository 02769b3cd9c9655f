"""Steps 1-3 of a GRPO step: sampling a group of completions per prompt (``engines/``, with tools and
environments in ``tools/``), scoring them, and their group-relative advantages; the records they fill
(``records``), DAPO's dynamic sampling and the asynchronous pipeline."""
