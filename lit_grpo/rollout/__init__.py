"""Steps 1-3 of a GRPO step: sampling a group of completions per prompt (``engines/``, with tools and
environments in ``tools/``), scoring them, and their group-relative advantages; the records they fill
(``records``), DAPO's dynamic sampling and the asynchronous pipeline."""


def __getattr__(name: str):
    """``from lit_grpo.rollout import Rollout``: ``lit_grpo.rollout`` was the records module before it
    became this package, and its names still import from here."""
    import importlib

    records = importlib.import_module("lit_grpo.rollout.records")  # (``from . import`` would come back here)
    if name in records.__all__:
        return getattr(records, name)
    raise AttributeError(f"module 'lit_grpo.rollout' has no attribute {name!r}")
