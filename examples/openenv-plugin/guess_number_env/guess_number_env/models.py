"""The action and observation of guess-number, as OpenEnv models them (pydantic)."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(description="the number guessed, from 1 to 8")


class GuessObservation(Observation):
    hint: str = Field(default="", description="higher, lower or correct; the rules after a reset")
    guesses: int = Field(default=0, description="guesses so far")
