"""``python -m lit_grpo.cli``: the ``lit-grpo`` command (what ``torchrun -m lit_grpo.cli`` starts on each rank)."""

from lit_grpo.cli import main

main()
