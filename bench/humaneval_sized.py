"""Eight programming tasks of HumanEval's size and shape, to time ``code_execution`` on realistic programs.

Each task is what a HumanEval sample gives a reward function: a solution of 5-25 lines (the prompt's
signature and docstring plus a body), and one test that defines ``check(candidate)`` with 5-10
assertions and calls it on the entry point. ``CORRECT`` solutions pass, ``WRONG`` ones (a plausible
off-by-one or misread) fail at least one assertion. Written for this benchmark in HumanEval's style;
not copied from the data set.
"""

from __future__ import annotations

TASKS: list[dict] = []


def _task(entry_point: str, correct: str, wrong: str, check: str) -> None:
    TASKS.append({
        "entry_point": entry_point, "correct": correct, "wrong": wrong,
        "test": check + f"\n\ncheck({entry_point})\n",
    })


_task("has_close_elements", '''
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)
    False
    """
    for idx, elem in enumerate(numbers):
        for idx2, elem2 in enumerate(numbers):
            if idx != idx2:
                distance = abs(elem - elem2)
                if distance < threshold:
                    return True
    return False
''', '''
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for a, b in zip(numbers, numbers[1:]):
        if abs(a - b) < threshold:
            return True
    return False
''', '''
def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False
    assert candidate([1.0, 2.0, 3.0, 4.0, 5.0, 2.0], 0.1) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5) == False
''')

_task("separate_paren_groups", '''
from typing import List


def separate_paren_groups(paren_string: str) -> List[str]:
    """ Separate balanced groups of nested parentheses into a list of strings, ignoring spaces.
    >>> separate_paren_groups('( ) (( )) (( )( ))')
    ['()', '(())', '(()())']
    """
    result = []
    current_string = []
    current_depth = 0
    for c in paren_string:
        if c == '(':
            current_depth += 1
            current_string.append(c)
        elif c == ')':
            current_depth -= 1
            current_string.append(c)
            if current_depth == 0:
                result.append(''.join(current_string))
                current_string.clear()
    return result
''', '''
from typing import List


def separate_paren_groups(paren_string: str) -> List[str]:
    return [group for group in paren_string.split(' ') if group]
''', '''
def check(candidate):
    assert candidate('(()()) ((())) () ((())()())') == ['(()())', '((()))', '()', '((())()())']
    assert candidate('() (()) ((())) (((())))') == ['()', '(())', '((()))', '(((())))']
    assert candidate('(()(())((())))') == ['(()(())((())))']
    assert candidate('( ) (( )) (( )( ))') == ['()', '(())', '(()())']
''')

_task("below_zero", '''
from typing import List


def below_zero(operations: List[int]) -> bool:
    """ Given deposit and withdrawal operations on an account that starts at zero, detect whether
    the balance ever falls below zero.
    >>> below_zero([1, 2, -4, 5])
    True
    """
    balance = 0
    for op in operations:
        balance += op
        if balance < 0:
            return True
    return False
''', '''
from typing import List


def below_zero(operations: List[int]) -> bool:
    return sum(operations) < 0
''', '''
def check(candidate):
    assert candidate([]) == False
    assert candidate([1, 2, -3, 1, 2, -3]) == False
    assert candidate([1, 2, -4, 5, 6]) == True
    assert candidate([1, -1, 2, -2, 5, -5, 4, -4]) == False
    assert candidate([1, -1, 2, -2, 5, -5, 4, -5]) == True
    assert candidate([1, -2, 2, -2, 5, -5, 4, -4]) == True
''')

_task("mean_absolute_deviation", '''
from typing import List


def mean_absolute_deviation(numbers: List[float]) -> float:
    """ Mean Absolute Deviation around the mean of this dataset.
    >>> mean_absolute_deviation([1.0, 2.0, 3.0, 4.0])
    1.0
    """
    mean = sum(numbers) / len(numbers)
    return sum(abs(x - mean) for x in numbers) / len(numbers)
''', '''
from typing import List


def mean_absolute_deviation(numbers: List[float]) -> float:
    mean = sum(numbers) / len(numbers)
    return sum(abs(x - mean) for x in numbers) / (len(numbers) - 1)
''', '''
def check(candidate):
    assert abs(candidate([1.0, 2.0, 3.0]) - 2.0/3.0) < 1e-6
    assert abs(candidate([1.0, 2.0, 3.0, 4.0]) - 1.0) < 1e-6
    assert abs(candidate([1.0, 2.0, 3.0, 4.0, 5.0]) - 6.0/5.0) < 1e-6
''')

_task("intersperse", '''
from typing import List


def intersperse(numbers: List[int], delimeter: int) -> List[int]:
    """ Insert a number 'delimeter' between every two consecutive elements of input list `numbers'
    >>> intersperse([1, 2, 3], 4)
    [1, 4, 2, 4, 3]
    """
    if not numbers:
        return []
    result = []
    for n in numbers[:-1]:
        result.append(n)
        result.append(delimeter)
    result.append(numbers[-1])
    return result
''', '''
from typing import List


def intersperse(numbers: List[int], delimeter: int) -> List[int]:
    result = []
    for n in numbers:
        result.append(n)
        result.append(delimeter)
    return result
''', '''
def check(candidate):
    assert candidate([], 7) == []
    assert candidate([5, 6, 3, 2], 8) == [5, 8, 6, 8, 3, 8, 2]
    assert candidate([2, 2, 2], 2) == [2, 2, 2, 2, 2]
''')

_task("parse_nested_parens", '''
from typing import List


def parse_nested_parens(paren_string: str) -> List[int]:
    """ For each space-separated group of nested parentheses, output the deepest level of nesting.
    >>> parse_nested_parens('(()()) ((())) () ((())()())')
    [2, 3, 1, 3]
    """
    def parse_paren_group(s):
        depth = 0
        max_depth = 0
        for c in s:
            if c == '(':
                depth += 1
                max_depth = max(depth, max_depth)
            else:
                depth -= 1
        return max_depth

    return [parse_paren_group(x) for x in paren_string.split(' ') if x]
''', '''
from typing import List


def parse_nested_parens(paren_string: str) -> List[int]:
    return [group.count('(') for group in paren_string.split(' ') if group]
''', '''
def check(candidate):
    assert candidate('(()()) ((())) () ((())()())') == [2, 3, 1, 3]
    assert candidate('() (()) ((())) (((())))') == [1, 2, 3, 4]
    assert candidate('(()(())((())))') == [4]
''')

_task("rolling_max", '''
from typing import List


def rolling_max(numbers: List[int]) -> List[int]:
    """ From a given list of integers, generate a list of rolling maximum element found until given
    moment in the sequence.
    >>> rolling_max([1, 2, 3, 2, 3, 4, 2])
    [1, 2, 3, 3, 3, 4, 4]
    """
    running_max = None
    result = []
    for n in numbers:
        if running_max is None:
            running_max = n
        else:
            running_max = max(running_max, n)
        result.append(running_max)
    return result
''', '''
from typing import List


def rolling_max(numbers: List[int]) -> List[int]:
    return [max(numbers[:i]) for i in range(1, len(numbers))]
''', '''
def check(candidate):
    assert candidate([]) == []
    assert candidate([1, 2, 3, 4]) == [1, 2, 3, 4]
    assert candidate([4, 3, 2, 1]) == [4, 4, 4, 4]
    assert candidate([3, 2, 3, 100, 3]) == [3, 3, 3, 100, 100]
''')

_task("make_palindrome", '''
def is_palindrome(string: str) -> bool:
    """ Test if given string is a palindrome """
    return string == string[::-1]


def make_palindrome(string: str) -> str:
    """ Find the shortest palindrome that begins with a supplied string.
    >>> make_palindrome('cat')
    'catac'
    """
    if not string:
        return ''
    beginning_of_suffix = 0
    while not is_palindrome(string[beginning_of_suffix:]):
        beginning_of_suffix += 1
    return string + string[:beginning_of_suffix][::-1]
''', '''
def is_palindrome(string: str) -> bool:
    return string == string[::-1]


def make_palindrome(string: str) -> str:
    return string + string[::-1]
''', '''
def check(candidate):
    assert candidate('') == ''
    assert candidate('x') == 'x'
    assert candidate('xyz') == 'xyzyx'
    assert candidate('xyx') == 'xyx'
    assert candidate('jerry') == 'jerryrrej'
''')
