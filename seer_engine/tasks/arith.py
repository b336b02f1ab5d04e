"""Multi-step arithmetic word problems (GSM8K-style answers after ``####``).

A character starts with some items and ``steps`` events change the count (gets
more, gives some away, buys boxes of several, doubles, keeps a fraction). Every
intermediate count is a positive integer no larger than ``max_total``, so the
answer is exact and a model's mistake is a real arithmetic or reading error.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from seer_engine.tasks.base import Gradable, Grade, Task, check_positive, first_number, last_number

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sofia", "Ken", "Ines", "Tom")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells", "cards", "stamps")
OPS = ("add", "sub", "groups", "mul", "div")
MARKER = "####"
_AFTER_MARKER = re.compile(re.escape(MARKER) + r"[ \t]*([^\n]*)")
# What follows an answer marker: a number, maybe after symbols ("$1234", "**42**", "-7").
# "#### Step 2: ..." is a Markdown heading, which small chat models write, not an answer.
_NUMBER_FIRST = re.compile(r"[^\w\n]*[-\u2212]?\d")


def _answer_after_marker(response: str) -> str | None:
    """The text after the last marker followed by a number; else after a marker that ends
    the response, whatever follows it ("#### The answer is 42"); else None."""
    marks = list(_AFTER_MARKER.finditer(response))
    numbered = [m.group(1) for m in marks if _NUMBER_FIRST.match(m.group(1))]
    if numbered:
        return numbered[-1]
    if marks and not response[marks[-1].end() :].strip():
        return marks[-1].group(1)
    return None


@dataclass
class ArithTask(Task):
    """``steps`` events after the start; operands up to ``max_operand``; counts up to
    ``max_total``; events drawn from ``ops`` (a subset of OPS: fewer kinds is easier)."""

    steps: int = 3
    max_operand: int = 20
    max_total: int = 500
    ops: tuple[str, ...] = OPS
    require_marker: bool = False  # False: a response without "####" is graded on its last number

    name = "arith"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self.name, steps=self.steps, max_operand=self.max_operand, max_total=self.max_total)
        if self.max_operand < 2 or self.max_total < 2 * self.max_operand:
            raise ValueError(
                f"arith: need max_operand >= 2 and max_total >= 2 * max_operand, "
                f"got max_operand={self.max_operand}, max_total={self.max_total}"
            )
        unknown = sorted(set(self.ops) - set(OPS))
        if unknown or not self.ops:
            raise ValueError(f"arith: ops must be a non-empty subset of {', '.join(OPS)}, got {self.ops}")

    def _make(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        name, items = rng.choice(NAMES), rng.choice(ITEMS)
        for _ in range(100):  # a start from which ``ops`` cannot go on is drawn again
            value = rng.randint(2, self.max_operand)
            sentences = [f"{name} has {value} {items}."]
            for _ in range(self.steps):
                usable = [o for o in self.ops if self._allowed(o, value)]
                if not usable:
                    break
                value, sentence = self._apply(rng.choice(usable), value, rng, name, items)
                sentences.append(sentence)
            else:
                question = " ".join(sentences) + f" How many {items} does {name} have now?"
                return question, str(value), {"answer": value}
        raise ValueError(
            f"arith: ops {self.ops} cannot make {self.steps} steps within max_total {self.max_total}"
        )

    def _allowed(self, op: str, value: int) -> bool:
        if op == "sub":
            return value >= 2
        if op == "groups":
            return value + 4 <= self.max_total
        if op == "mul":
            return value * 2 <= self.max_total
        if op == "div":
            return any(value % f == 0 for f in (2, 3, 4))
        return value + 1 <= self.max_total  # add

    def _apply(self, op: str, value: int, rng: random.Random, name: str, items: str) -> tuple[int, str]:
        if op == "add":
            k = rng.randint(1, min(self.max_operand, self.max_total - value))
            more = f"{k} more {_noun(k, items)}"
            text = rng.choice([f"{name} buys {more}.", f"Then {name} finds {more}."])
            return value + k, text
        if op == "sub":
            k = rng.randint(1, min(self.max_operand, value - 1))
            lost = f"{k} {_noun(k, items)}"
            text = rng.choice([f"{name} gives {lost} to a friend.", f"Then {name} loses {lost}."])
            return value - k, text
        if op == "groups":
            boxes = rng.randint(2, min(6, max(2, (self.max_total - value) // 2)))
            each = rng.randint(2, max(2, min(self.max_operand, (self.max_total - value) // boxes)))
            return value + boxes * each, f"{name} buys {boxes} boxes with {each} {items} in each box."
        if op == "mul":
            factor = rng.choice([f for f in (2, 3) if value * f <= self.max_total])
            word = {2: "doubles", 3: "triples"}[factor]
            return value * factor, f"Then the number of {items} {name} has {word}."
        factor = rng.choice([f for f in (2, 3, 4) if value % f == 0])
        if factor == 2:
            return value // 2, f"{name} gives away half of the {items}."
        return value // factor, f"{name} splits the {items} equally into {factor} bags and keeps one bag."

    def instructions(self, data: dict[str, Any]) -> str:
        # No example number: small models copy it as their answer.
        return (
            "Solve the problem step by step. On the last line, write the final answer "
            f"after '{MARKER}', like this: {MARKER} <number>"
        )

    def grade(self, problem: Gradable, response: str) -> Grade:
        """1 when the number after the last ``####`` answer (else, unless ``require_marker``,
        the last number of the response) equals the answer; 0 otherwise."""
        marked = _answer_after_marker(response)
        if marked is not None:
            parsed = first_number(marked)  # "#### 42 apples (or 43)" answers 42
        elif self.require_marker:
            return Grade(0.0, None, "no_marker")
        else:
            parsed = last_number(response)
        if parsed is None:
            return Grade(0.0, None, "no_answer")
        try:
            correct = Fraction(parsed) == Fraction(problem.answer)
        except (ValueError, ZeroDivisionError):
            return Grade(0.0, parsed, "no_answer")
        return Grade(1.0, parsed, "correct") if correct else Grade(0.0, parsed, "wrong")


def _noun(k: int, items: str) -> str:
    """'apple' after 1, 'apples' otherwise (every item name is a plural in -s)."""
    return items[:-1] if k == 1 else items
