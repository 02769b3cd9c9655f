"""What a reward's failure on a sample says: which sample, the reward's own traceback, what keeps training.

A reward that raises, times out or kills its worker process on a sample is reported with that
sample's index and an excerpt of its prompt and completion, a short traceback of the reward's own
frames (the frames of lit-grpo that called it are left out), and, when ``on_error: raise`` stopped
the run, the ``on_error`` setting that would have kept it going.

Standard-library only: worker processes (:mod:`lit_grpo.scoring.pool`) format their tracebacks here.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SampleFailure", "indent", "keep_training_hint", "preview", "reward_traceback", "sample_lines"]

# The lit_grpo package: frames of files below it are lit-grpo's, not the reward's.
_LIT_GRPO = Path(__file__).resolve().parents[1]
# How many of the reward's frames a traceback shows, the last ones (where it failed).
TRACEBACK_FRAMES = 5
# Characters of a prompt, a completion or a returned value that a message shows.
PREVIEW_CHARS = 200


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
