"""vf-arithmetic: a verifiers ToolEnv. Each problem asks for the sum of two numbers; the model may call
the ``add`` tool and answers with the number. The rubric rewards the right answer (weight 1.0) and an
answer of digits only (weight 0.2); verifiers' ToolEnv adds its tool-call counts (weight 0).

    import verifiers as vf
    env = vf.load_environment("vf-arithmetic", num_examples=64, seed=0)
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def _problems(count: int, seed: int, max_operand: int) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"question": f"What is {a} + {b}? Use the add tool, then answer with the number.",
                     "answer": str(a + b), "info": {"a": a, "b": b}})
    return Dataset.from_list(rows)


def load_environment(num_examples: int = 64, num_eval_examples: int = 16, seed: int = 0, max_operand: int = 9,
                     max_turns: int = 4) -> vf.Environment:
    parser = vf.Parser()

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def digits_only(completion, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip().isdigit() else 0.0

    rubric = vf.Rubric(funcs=[correct_answer, digits_only], weights=[1.0, 0.2], parser=parser)
    return vf.ToolEnv(dataset=_problems(num_examples, seed, max_operand),
                      eval_dataset=_problems(num_eval_examples, seed + 1, max_operand),
                      tools=[add], max_turns=max_turns, parser=parser, rubric=rubric,
                      system_prompt="You add numbers with the add tool.")
