"""Benchmarks and checks of lit-grpo (run as modules: ``python -m bench.<name>``)."""
