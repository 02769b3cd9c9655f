"""The guess-number server: ``python -m uvicorn guess_number_env.server.app:app --port 8000``."""

from openenv.core.env_server.http_server import create_app

from guess_number_env.models import GuessAction, GuessObservation
from guess_number_env.server.environment import GuessNumberEnvironment

app = create_app(GuessNumberEnvironment, GuessAction, GuessObservation, env_name="guess_number", max_concurrent_envs=64)
