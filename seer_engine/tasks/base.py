"""What every verifiable task shares: problems, grades, seeding and prompt records.

A task makes problems with exact answers and grades a model's response to one.
Problem ``i`` of seed ``s`` is drawn from its own generator (seeded by task name,
seed and index), so the first n problems of a seed are the same whatever n is,
and a rollout that grows its prompt set keeps the old prompts.
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Protocol

Message = dict[str, str]

# Digits and the commas between them, then a decimal or a fraction ("9/2" is 4.5, not 9
# then 2). U+2212 is typeset math's minus sign.
_NUMBER = re.compile(r"[-\u2212]?\d+(?:,\d+)*(?:\.\d+|/\d+)?")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")


@dataclass
class Problem:
    """One prompt of a task with its reference answer and what grading needs."""

    task: str
    seed: int
    index: int
    question: str  # the problem alone, without the answer-format instructions
    messages: list[Message]  # the chat to send (the format instructions included)
    answer: str  # the reference answer (a number, or a solving expression)
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.task}-{self.seed}-{self.index}"


class Gradable(Protocol):
    """What grading reads: a Problem, or a TaskPrompt read back from a JSON line."""

    answer: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Grade:
    """A response's reward in [0, 1], what was read from it, and why it scored so."""

    reward: float
    parsed: str | None
    verdict: str  # "correct" or the reason it is not


class Task(ABC):
    """A generator of problems plus their grader; difficulty knobs are dataclass fields."""

    name: ClassVar[str]

    def __post_init__(self) -> None:
        """Each knob of its default's type (a tuple knob may come as a list): a wrong type
        is an error naming the knob, not a TypeError later or a silently different task
        (the string "false" is truthy; the string "add" is the ops a, d, d)."""
        for f in fields(self):  # type: ignore[arg-type]
            value, default = getattr(self, f.name), f.default
            if isinstance(default, bool):
                ok, wants = isinstance(value, bool), "bool"
            elif isinstance(default, int):
                ok, wants = isinstance(value, int) and not isinstance(value, bool), "int"
            elif isinstance(default, tuple):
                ok = isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value)
                wants = "tuple of str"
                if ok:
                    setattr(self, f.name, tuple(value))
            else:
                continue
            if not ok:
                raise ValueError(f"{self.name}: knob {f.name} wants {wants}, got {value!r}")

    def problems(self, n: int, seed: int = 0) -> list[Problem]:
        if n < 0:
            raise ValueError(f"number of problems must be >= 0, got {n}")
        return [self.problem(seed, i) for i in range(n)]

    def problem(self, seed: int, index: int) -> Problem:
        rng = random.Random(f"{self.name}|{seed}|{index}")  # str seeds hash the same in every run
        question, answer, data = self._make(rng)
        messages = [{"role": "user", "content": f"{question}\n\n{self.instructions(data)}"}]
        return Problem(self.name, seed, index, question, messages, answer, data)

    def reward(self, problem: Gradable, response: str) -> float:
        return self.grade(problem, response).reward

    def knobs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @abstractmethod
    def _make(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        """(question, reference answer, grading data) of one problem."""

    @abstractmethod
    def instructions(self, data: dict[str, Any]) -> str:
        """The answer-format instructions appended to the question."""

    @abstractmethod
    def grade(self, problem: Gradable, response: str) -> Grade: ...


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (see ``_plain``; a fraction whole), or None."""
    found = _NUMBER.findall(text)
    return _plain(found[-1]) if found else None


def first_number(text: str) -> str | None:
    """The first number written in ``text`` (see ``_plain``; a fraction whole), or None."""
    match = _NUMBER.search(text)
    return _plain(match.group(0)) if match else None


def _plain(number: str) -> str:
    """A number as read, without thousands commas and with an ASCII minus: a typeset
    minus sign (U+2212) before 7 makes it -7, not a 7 after an unknown character. Commas
    that do not group thousands ("1,2,3", a decimal comma "12,5") are kept: no number
    reads that text, so it is neither 123 nor 125."""
    number = number.replace("\u2212", "-")
    integer = number.lstrip("-").split(".")[0].split("/")[0]
    if "," in integer and not _THOUSANDS.fullmatch(integer):
        return number
    return number.replace(",", "")


def check_positive(task: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{task}: {name} must be >= 1, got {value}")


@dataclass
class TaskPrompt:
    """A problem as a rollout prompt: its chat, reference answer and (optionally) text."""

    id: str
    task: str
    messages: list[Message]
    answer: str
    data: dict[str, Any]
    text: str | None = None  # the messages through a chat template, when one was given

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_task_prompts(
    task: Task,
    n: int,
    seed: int = 0,
    chat_template: Callable[[list[Message]], str] | None = None,
) -> list[TaskPrompt]:
    """The first ``n`` problems of ``seed`` as prompts; ``chat_template`` (e.g. a
    tokenizer's ``apply_chat_template`` with the generation prompt) renders ``text``."""
    out = []
    for p in task.problems(n, seed):
        text = chat_template(p.messages) if chat_template is not None else None
        out.append(TaskPrompt(p.id, p.task, p.messages, p.answer, p.data, text))
    return out
