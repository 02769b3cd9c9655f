"""guess-number: an OpenEnv environment. ``reset(seed)`` picks a secret number from 1 to 8; each step
guesses one and is told ``higher``, ``lower`` or ``correct`` (reward 1.0, the episode ends); the episode
also ends after 4 wrong guesses."""

from guess_number_env.models import GuessAction, GuessObservation

__all__ = ["GuessAction", "GuessObservation"]
