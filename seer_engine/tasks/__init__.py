"""Verifiable RL tasks: seeded problem generators with exact answers and rewards.

``get_task("arith", steps=4)`` returns a configured task; ``task.problems(n, seed)``
gives chat-formatted problems and ``task.grade(problem, response)`` the reward in
[0, 1] with what was parsed. ``task_prompts`` turns problems into rollout prompts.
Standard library only: the caller supplies the tokenizer's chat template if any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from seer_engine.tasks.arith import ArithTask
from seer_engine.tasks.base import Grade, Message, Problem, Task, TaskPrompt, make_task_prompts
from seer_engine.tasks.countdown import CountdownTask, ExpressionError, evaluate

__all__ = [
    "TASKS",
    "ArithTask",
    "CountdownTask",
    "ExpressionError",
    "Grade",
    "Problem",
    "Task",
    "TaskPrompt",
    "evaluate",
    "get_task",
    "parse_knobs",
    "task_prompts",
]

TASKS: dict[str, type[Task]] = {"arith": ArithTask, "countdown": CountdownTask}


def get_task(name: str, **knobs: Any) -> Task:
    """The task ``name`` with its difficulty knobs (unknown names and knobs are clear errors)."""
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    allowed = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(knobs) - set(allowed))
    if unknown:
        raise ValueError(f"task {name!r} has no knob {', '.join(unknown)}; its knobs: {', '.join(allowed)}")
    return cls(**knobs)


def parse_knobs(name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """Command-line knobs (``["steps=2", "ops=add,sub"]``) as ``get_task`` takes them,
    each converted to the type of its default (a tuple knob is comma-separated)."""
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    defaults = {f.name: f.default for f in fields(cls)}  # type: ignore[arg-type]
    knobs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ValueError(f"task knob {pair!r} is not KEY=VALUE")
        if key not in defaults:
            raise ValueError(f"task {name!r} has no knob {key}; its knobs: {', '.join(defaults)}")
        knobs[key] = _convert(name, key, value, defaults[key])
    return knobs


def _convert(task: str, key: str, value: str, default: Any) -> Any:
    if isinstance(default, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"task {task!r} knob {key} wants true or false, got {value!r}")
        return value.lower() in ("true", "1")
    if isinstance(default, tuple):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    kind = type(default)
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"task {task!r} knob {key} wants {kind.__name__}, got {value!r}") from None


def task_prompts(
    task: str | Task,
    n: int,
    seed: int = 0,
    chat_template: Callable[[list[Message]], str] | None = None,
    **knobs: Any,
) -> list[TaskPrompt]:
    """The first ``n`` problems of ``seed`` as prompts with reference answers (what
    ``seer_engine rollout --task`` sends); grade a response with
    ``get_task(p.task, **knobs).grade(p, text)``."""
    if isinstance(task, str):
        task = get_task(task, **knobs)
    elif knobs:
        raise ValueError("knobs go with a task name, not with a task object")
    return make_task_prompts(task, n, seed, chat_template)
