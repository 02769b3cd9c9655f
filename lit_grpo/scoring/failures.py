"""What a reward's failure on a sample says: which sample, the reward's own traceback, what keeps training.

A reward that raises, times out or kills its worker process on a sample is reported with that
sample's index and an excerpt of its prompt and completion, a short traceback of the reward's own
frames (the frames of lit-grpo that called it are left out), and, when ``on_error: raise`` stopped
the run, the ``on_error`` setting that would have kept it going.

Standard-library only: worker processes (:mod:`lit_grpo.scoring.pool`) format their tracebacks here.
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FailureReports", "SampleFailure", "indent", "keep_training_hint", "preview", "reward_traceback", "sample_lines"]

# The lit_grpo package: frames of files below it are lit-grpo's, not the reward's.
_LIT_GRPO = Path(__file__).resolve().parents[1]
# How many of the reward's frames a traceback shows, the last ones (where it failed).
TRACEBACK_FRAMES = 5
# Characters of a prompt, a completion or a returned value that a message shows.
PREVIEW_CHARS = 200
# With on_error none/zero, a reward that goes on failing is summed up in one line every this many
# calls that failed (training steps, for model.rewards); the count of every step is in the metrics.
SUMMARY_EVERY = 50


def _is_lit_grpo(frame: traceback.FrameSummary) -> bool:
    return Path(frame.filename).resolve().is_relative_to(_LIT_GRPO)


def reward_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, but with the reward's own frames only: those after
    the last frame of lit-grpo (if the reward called lit-grpo, which raised: every frame not of
    lit-grpo), at most the last :data:`TRACEBACK_FRAMES`."""
    frames = traceback.extract_tb(exc.__traceback__)
    last_ours = max((i for i, frame in enumerate(frames) if _is_lit_grpo(frame)), default=-1)
    own = frames[last_ours + 1 :] or [frame for frame in frames if not _is_lit_grpo(frame)]
    shown = own[-TRACEBACK_FRAMES:]
    lines = ["Traceback (most recent call last):\n"]
    if len(own) > len(shown):
        lines.append(f"  ... {len(own) - len(shown)} earlier frames of the reward\n")
    for frame in shown:  # as Python prints a frame, without the ^^^ marks under the expression
        lines.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}\n')
        if frame.line:
            lines.append(f"    {frame.line}\n")
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def preview(value: object) -> str:
    """``repr(value)``, cut to :data:`PREVIEW_CHARS` characters."""
    text = repr(value)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."


def indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


@dataclass
class SampleFailure:
    """One sample a reward failed on (``index`` None: a call with the whole batch). ``kind``:
    ``exception``, ``timeout`` or ``crash`` (its worker process died); ``traceback``: the reward's
    frames (:func:`reward_traceback`), or ``""``."""

    index: int | None
    kind: str
    type_name: str
    message: str
    traceback: str = ""
    exception: BaseException | None = field(default=None, repr=False)  # in this process only

    @classmethod
    def from_exception(cls, index: int | None, exc: BaseException, timed_out: bool = False) -> SampleFailure:
        if timed_out:
            return cls(index, "timeout", "TimeoutError", str(exc))
        return cls(index, "exception", type(exc).__name__, str(exc), reward_traceback(exc), exc)

    @property
    def summary(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name

    def headline(self, who: str, timeout: float | None) -> str:
        """``Reward 'x' (package) raised ValueError: ...`` (or timed out, or failed)."""
        if self.kind == "timeout":
            return f"{who} timed out after {timeout:g} s"
        if self.kind == "crash":
            return f"{who} failed: {self.message}"
        return f"{who} raised {self.summary}"


def sample_lines(index: int, prompts: list, completions: list) -> list[str]:
    """The excerpt of sample ``index`` that a failure shows."""
    return [f"  prompt:     {preview(prompts[index])}", f"  completion: {preview(completions[index])}"]


def keep_training_hint(key: str) -> str:
    """What would have kept the run going (``key``: the reward's entry, ``model.rewards[0]``)."""
    return (
        f"To keep training, set {key}.on_error: none (or zero): the samples it fails on then score None "
        "(or 0.0), each failure is logged, and they are counted in rewards/<name>/errors."
    )


class FailureReports:
    """When the failures of one reward that keeps training (``on_error: none`` or ``zero``) are said:
    the first failure of each error type in full (:meth:`first_of_its_kind`: its sample, its
    traceback); after that, one line every ``every`` calls that failed (:meth:`summary_due`), summing
    the failures since the last line. Every call's count is logged as ``rewards/<name>/errors``."""

    def __init__(self, every: int = SUMMARY_EVERY) -> None:
        self.every = every
        self.reported_kinds: set[str] = set()
        self.failed_calls = 0  # calls that failed since the last line said
        self.failures: Counter[str] = Counter()  # failures by error type since the last line said
        self.samples = 0  # samples scored in those calls

    def first_of_its_kind(self, errors: list[SampleFailure]) -> SampleFailure | None:
        """The first failure in ``errors`` of an error type not reported yet, now reported; else None."""
        for error in errors:
            if error.type_name not in self.reported_kinds:
                self.reported_kinds.add(error.type_name)
                return error
        return None

    def count(self, errors: list[SampleFailure], samples: int) -> None:
        self.failed_calls += 1
        self.failures.update(error.type_name for error in errors)
        self.samples += samples

    def summary_due(self) -> str | None:
        """``failed on F of S samples in the last C calls (...)`` once ``every`` calls failed, else None."""
        if self.failed_calls < self.every:
            return None
        kinds = ", ".join(f"{count} {name}" for name, count in self.failures.most_common())
        line = (f"failed on {sum(self.failures.values())} of {self.samples} samples in the last {self.failed_calls} "
                f"calls that failed ({kinds})")
        self.failed_calls, self.failures, self.samples = 0, Counter(), 0
        return line
