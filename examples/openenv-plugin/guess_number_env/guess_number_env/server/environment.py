"""The server side of guess-number: an OpenEnv ``Environment``."""

from __future__ import annotations

import random
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from guess_number_env.models import GuessAction, GuessObservation

HIGHEST = 8
MAX_GUESSES = 4


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session: rollouts run side by side

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.secret = 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, HIGHEST)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GuessObservation(hint=f"Guess a number from 1 to {HIGHEST}; you have {MAX_GUESSES} guesses.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        correct = action.guess == self.secret
        hint = "correct" if correct else "higher" if action.guess < self.secret else "lower"
        done = correct or self._state.step_count >= MAX_GUESSES
        return GuessObservation(hint=hint, guesses=self._state.step_count, done=done, reward=1.0 if correct else 0.0)

    @property
    def state(self) -> State:
        return self._state
