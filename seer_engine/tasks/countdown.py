"""Countdown: reach a target with given numbers, each used at most once, and + - * /.

Every target is built from the numbers themselves (a random subset combined with
random operations, every intermediate a positive integer), so each problem has a
solution; the reference answer is that expression. The grader parses the model's
expression with ``ast`` and evaluates it over exact fractions, allowing nothing but
integer literals, the four operators and parentheses: no names, calls, powers,
attributes or floats are ever evaluated.
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from seer_engine.tasks.base import Gradable, Grade, Task, check_positive

MAX_EXPRESSION_CHARS = 200
# A tag's text ends at the next opening tag: a scan from every unclosed tag to the end of
# the response would make grading quadratic in a model's degenerate repetitions.
_ANSWER = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL | re.IGNORECASE)
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_LOOKALIKES = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})


class ExpressionError(ValueError):
    """An expression the grader refuses: the message says what is not allowed."""


def answer_limit(numbers: Sequence[int]) -> int:
    """The longest answer graded for these numbers: MAX_EXPRESSION_CHARS, or room for each
    number with an operator, parentheses and spaces when that is more (a problem of many
    numbers has solutions longer than a fixed limit)."""
    return max(MAX_EXPRESSION_CHARS, sum(len(str(x)) + 8 for x in numbers))


def evaluate(expression: str, max_chars: int = MAX_EXPRESSION_CHARS) -> tuple[Fraction, list[int]]:
    """(exact value, integer literals used) of an arithmetic expression.

    Raises ExpressionError for anything but non-negative integer literals combined
    with + - * / and parentheses (or more than ``max_chars`` characters, or nested
    deeper than Python's recursion allows), and ZeroDivisionError for a division by zero.
    """
    if len(expression) > max_chars:
        raise ExpressionError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        detail = e.msg if isinstance(e, SyntaxError) else str(e)
        raise ExpressionError(f"not an arithmetic expression: {detail}") from None
    except (RecursionError, MemoryError):  # MemoryError: the parser's stack (3.11) on deep nesting
        raise ExpressionError("expression nested too deeply") from None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            return left / right  # Fraction: exact, ZeroDivisionError on 0
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        kind = type(node).__name__
        raise ExpressionError(f"{kind} is not allowed (only integers, + - * / and parentheses)")

    try:
        return walk(tree.body), used
    except RecursionError:
        raise ExpressionError("expression nested too deeply") from None


def extract_answer(response: str) -> str | None:
    """The expression in the last ``<answer>...</answer>`` (from the last opening tag before
    it), without the ``$`` or backtick delimiters around it (or around each side) and an
    ``= N`` after or before it (``93 = 25 * 4 - 7``). Any run of whitespace (a line break,
    a no-break space) is one space: Python would refuse it inside an expression."""
    found = _ANSWER.findall(response)
    if not found:
        return None
    text = " ".join(found[-1].translate(_LOOKALIKES).split())
    sides = [side.strip().strip("$`").strip() for side in text.split("=")]
    return next((side for side in sides if side and not side.isdigit()), sides[0]) or None


@dataclass
class CountdownTask(Task):
    """``numbers`` numbers from 1..``max_number``; targets in [``min_target``, ``max_target``]."""

    numbers: int = 4
    max_number: int = 25
    min_target: int = 10
    max_target: int = 200
    min_used: int = 2  # the built solution uses at least this many numbers

    name = "countdown"
    _ATTEMPTS = 1000

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(
            self.name, numbers=self.numbers, max_number=self.max_number, min_target=self.min_target
        )
        if not 2 <= self.min_used <= self.numbers:
            raise ValueError(f"countdown: need 2 <= min_used <= numbers, got {self.min_used}, {self.numbers}")
        if self.max_target < self.min_target:
            raise ValueError(f"countdown: max_target {self.max_target} < min_target {self.min_target}")

    def _make(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        for _ in range(self._ATTEMPTS):
            nums = [rng.randint(1, self.max_number) for _ in range(self.numbers)]
            subset = rng.sample(nums, rng.randint(self.min_used, self.numbers))
            value, expr = subset[0], str(subset[0])
            for x in subset[1:]:
                ops = ["+", "*"] + (["-"] if value > x else []) + (["/"] if x > 1 and value % x == 0 else [])
                op = rng.choice(ops)
                value = {"+": value + x, "-": value - x, "*": value * x, "/": value // x}[op]
                expr = f"({expr} {op} {x})"
            if self.min_target <= value <= self.max_target and value not in nums:
                question = (
                    f"Using the numbers {nums}, write an arithmetic expression that equals {value}. "
                    "You may use +, -, * and / and parentheses. Each number may be used at most once "
                    "(you do not have to use all of them)."
                )
                return question, expr[1:-1], {"numbers": nums, "target": value}
        raise ValueError(
            f"countdown: found no target in [{self.min_target}, {self.max_target}] from {self.numbers} "
            f"numbers up to {self.max_number} after {self._ATTEMPTS} tries; widen the target range"
        )

    def instructions(self, data: dict[str, Any]) -> str:
        # No example expression: small models copy it as their answer.
        return (
            "Think it through, then write only the final expression between answer tags, "
            "like this: <answer>expression</answer>"
        )

    def grade(self, problem: Gradable, response: str) -> Grade:
        """1 when the last <answer> expression uses only the given numbers (each at most
        as often as given) and equals the target exactly; 0 otherwise."""
        expr = extract_answer(response)
        if expr is None:
            return Grade(0.0, None, "no_answer")
        try:
            value, used = evaluate(expr, answer_limit(problem.data["numbers"]))
        except ExpressionError:
            return Grade(0.0, expr, "invalid_expression")
        except ZeroDivisionError:
            return Grade(0.0, expr, "division_by_zero")
        if Counter(used) - Counter(problem.data["numbers"]):
            return Grade(0.0, expr, "numbers_not_allowed")
        if value != problem.data["target"]:
            return Grade(0.0, expr, "wrong_value")
        return Grade(1.0, expr, "correct")
