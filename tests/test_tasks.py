"""Verifiable tasks: generators give exact answers, graders read answers strictly and safely."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from fractions import Fraction

import pytest

from seer_engine.tasks import (
    TASKS,
    ArithTask,
    CountdownTask,
    ExpressionError,
    TaskPrompt,
    evaluate,
    get_task,
    task_prompts,
)

# ----------------------------------------------------------------------------- generation


def replay_arith(question: str) -> int:
    """Recompute an arith problem's answer from its text alone (an independent reading)."""
    sentences = re.findall(r"[^.?]+[.?]", question)
    value = int(re.search(r"has (\d+) ", sentences[0]).group(1))
    for s in sentences[1:-1]:
        n = [int(x) for x in re.findall(r"\d+", s)]
        if "boxes with" in s:
            value += n[0] * n[1]
        elif "more" in s:
            value += n[0]
        elif "to a friend" in s or "loses" in s:
            value -= n[0]
        elif "doubles" in s:
            value *= 2
        elif "triples" in s:
            value *= 3
        elif "half" in s:
            assert value % 2 == 0
            value //= 2
        elif "keeps one bag" in s:
            assert value % n[0] == 0
            value //= n[0]
        else:
            raise AssertionError(f"unknown sentence {s!r}")
        assert value >= 1, question
    return value


ARITH_KNOBS = [
    {},
    {"steps": 1},
    {"steps": 6, "max_operand": 50, "max_total": 2000},
    {"steps": 4, "ops": ("add", "sub")},
    {"steps": 2, "ops": ("div", "mul")},
]


@pytest.mark.parametrize("knobs", ARITH_KNOBS)
def test_arith_answers_are_exact(knobs):
    task = get_task("arith", **knobs)
    steps = knobs.get("steps", 3)
    for p in task.problems(200, seed=3):
        assert replay_arith(p.question) == int(p.answer) == p.data["answer"]
        assert int(p.answer) <= task.max_total
        assert len(re.findall(r"[.?](?: |$)", p.question)) == steps + 2  # start, steps, question
        assert "####" in p.messages[-1]["content"] and p.messages[-1]["role"] == "user"
        if "ops" in knobs:
            kinds = {"add": "more", "sub": "friend|loses", "div": "half|keeps one", "mul": "doubles|triples"}
            pattern = "|".join(kinds[o] for o in knobs["ops"])
            assert all(re.search(pattern, s) for s in re.findall(r"[^.?]+[.?]", p.question)[1:-1])


HARD_COUNTDOWN = {"numbers": 6, "max_number": 100, "min_target": 100, "max_target": 999}


@pytest.mark.parametrize("knobs", [{}, HARD_COUNTDOWN])
def test_countdown_problems_are_solvable(knobs):
    task = get_task("countdown", **knobs)
    for p in task.problems(200, seed=5):
        nums, target = p.data["numbers"], p.data["target"]
        assert len(nums) == task.numbers and all(1 <= x <= task.max_number for x in nums)
        assert task.min_target <= target <= task.max_target and target not in nums
        value, used = evaluate(p.answer)
        assert value == target and not Counter(used) - Counter(nums)
        assert task.grade(p, f"<answer>{p.answer}</answer>").verdict == "correct"
        assert str(nums) in p.question and "<answer>" in p.messages[-1]["content"]


def test_countdown_with_many_numbers_grades_its_own_answers():
    """The longest answer graded grows with the numbers given: a problem of 40 numbers
    (its solution over 200 characters) is still solved by its reference answer, and a
    long chain of literals is refused as an expression, never a RecursionError."""
    task = get_task("countdown", numbers=40, min_used=40, max_target=10**200)
    problems = task.problems(5, seed=1)
    assert max(len(p.answer) for p in problems) > 200
    for p in problems:
        assert task.grade(p, f"<answer>{p.answer}</answer>").verdict == "correct"
    for terms in (1500, 5000):  # too deep for the evaluator, and for Python's parser
        chain = "+".join(["1"] * terms)
        problem = TaskPrompt("c", "countdown", [], "1 + 1", {"numbers": [1] * terms, "target": terms})
        assert task.grade(problem, f"<answer>{chain}</answer>").verdict == "invalid_expression"
        with pytest.raises(ExpressionError, match="nested too deeply"):
            evaluate(chain, max_chars=len(chain))


@pytest.mark.parametrize("name", list(TASKS))
def test_seeded_and_prefix_stable(name):
    task = get_task(name)
    a, b = task.problems(20, seed=7), task.problems(20, seed=7)
    assert [(p.messages, p.answer, p.data) for p in a] == [(p.messages, p.answer, p.data) for p in b]
    assert [p.messages for p in task.problems(5, seed=7)] == [p.messages for p in a[:5]]
    other = task.problems(20, seed=8)
    assert sum(x.question != y.question for x, y in zip(a, other)) >= 18
    assert len({p.question for p in a}) >= 18  # problems within a seed differ too
    assert [p.id for p in a[:2]] == [f"{name}-7-0", f"{name}-7-1"]


def test_same_problems_in_another_process():
    """Seeds are strings hashed by random itself, not by hash(): PYTHONHASHSEED changes nothing."""
    code = (
        "import json; from seer_engine.tasks import task_prompts as tp; "
        "print(json.dumps([p.to_json() for n in ('arith', 'countdown') for p in tp(n, 5, seed=11)]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    here = [p.to_json() for n in ("arith", "countdown") for p in task_prompts(n, 5, seed=11)]
    assert json.loads(out.stdout) == here


def test_registry_and_knob_errors():
    assert isinstance(get_task("arith"), ArithTask) and isinstance(get_task("countdown"), CountdownTask)
    assert get_task("arith", steps=5).knobs()["steps"] == 5
    with pytest.raises(ValueError, match="unknown task 'gsm8k'; choose one of arith, countdown"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="task 'arith' has no knob digits; its knobs: steps, max_operand"):
        get_task("arith", digits=3)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        get_task("arith", steps=0)
    with pytest.raises(ValueError, match="ops must be a non-empty subset of add, sub, groups, mul, div"):
        get_task("arith", ops=("add", "pow"))
    with pytest.raises(ValueError, match="cannot make 20 steps within max_total 40"):
        get_task("arith", ops=("mul",), steps=20, max_total=40).problems(1)
    with pytest.raises(ValueError, match="min_used <= numbers"):
        get_task("countdown", numbers=3, min_used=4)
    with pytest.raises(ValueError, match="found no target in \\[500, 600\\]"):
        get_task("countdown", numbers=2, max_number=3, min_target=500, max_target=600).problems(1)


@pytest.mark.parametrize(
    ("name", "knob", "value", "wants"),
    [
        ("arith", "steps", "3", "int"),
        ("arith", "steps", 2.5, "int"),
        ("arith", "steps", True, "int"),
        ("arith", "ops", "add", "tuple of str"),  # not the letters a, d, d
        ("arith", "ops", None, "tuple of str"),
        ("arith", "require_marker", "false", "bool"),  # a truthy string: it would require the marker
        ("countdown", "numbers", 4.0, "int"),
        ("countdown", "max_target", "200", "int"),
    ],
)
def test_knobs_of_the_wrong_type_are_errors_naming_the_knob(name, knob, value, wants):
    with pytest.raises(ValueError, match=f"{name}: knob {knob} wants {wants}, got {re.escape(repr(value))}"):
        get_task(name, **{knob: value})
    assert get_task("arith", ops=["add", "sub"]).ops == ("add", "sub")  # a list is fine


def test_task_prompts_for_the_rollout(tiny_model):
    from seer_engine.engine.detokenizer import Detokenizer

    tok = Detokenizer.from_pretrained(tiny_model("qwen3"))
    prompts = task_prompts("countdown", 4, seed=2, chat_template=tok.apply_chat_template, numbers=5)
    task = get_task("countdown", numbers=5)
    assert [p.id for p in prompts] == [p.id for p in task.problems(4, seed=2)]
    for p in prompts:
        assert p.text == tok.apply_chat_template(p.messages) and p.text.endswith("<|im_start|>assistant\n")
        back = TaskPrompt(**json.loads(json.dumps(p.to_json())))  # a JSON line read back by the CLI
        assert task.grade(back, f"<answer>{p.answer}</answer>").reward == 1.0
        assert len(p.data["numbers"]) == 5
    assert task_prompts("arith", 2)[0].text is None


def test_task_groups_keep_the_chat_templates_bos_single(tiny_model):
    """A task's prompt is rendered by the chat template, which writes the BOS itself: its
    tokens are the rendered text's without the tokenizer's special tokens added again."""
    from transformers import AutoTokenizer

    from seer_engine import SamplingParams
    from seer_engine.engine.detokenizer import Detokenizer
    from seer_engine.engine.input_processor import InputProcessor
    from seer_engine.entrypoints.rollout_cli import task_groups

    path = tiny_model("llama", add_bos=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    processor = InputProcessor(Detokenizer.from_pretrained(path), len(tok), 512, 1024, 16)
    prompts, groups = task_groups(get_task("arith"), 3, 0, 2, SamplingParams(max_tokens=8), processor)
    for p, g in zip(prompts, groups):
        ids = tok(p.text, add_special_tokens=False).input_ids
        assert g.prompt_token_ids == ids and ids[0] == tok.bos_token_id != ids[1]


# ----------------------------------------------------------------------------- grading


@pytest.fixture
def arith_problem():
    p = get_task("arith").problems(1)[0]
    p.answer, p.data = "1234", {"answer": 1234}  # a fixed answer for the grading table
    return p


@pytest.mark.parametrize(
    ("response", "reward", "parsed", "verdict"),
    [
        ("First 1000, then 234 more.\n#### 1234", 1.0, "1234", "correct"),
        ("#### 1,234", 1.0, "1234", "correct"),
        ("#### 1234.0", 1.0, "1234.0", "correct"),
        ("#### $1234 apples (not 1235)", 1.0, "1234", "correct"),
        ("#### 1000\nWait, I was wrong.\n#### 1234", 1.0, "1234", "correct"),
        ("#### 1233", 0.0, "1233", "wrong"),
        ("#### -1234", 0.0, "-1234", "wrong"),
        ("#### \u22121234", 0.0, "-1234", "wrong"),  # the unicode minus sign is a minus too
        ("So it is \u22121234.", 0.0, "-1234", "wrong"),
        ("So the answer is 1234.", 1.0, "1234", "correct"),  # no marker: the last number
        ("1234 at first, but the answer is 99", 0.0, "99", "wrong"),
        ("#### many", 0.0, None, "no_answer"),
        ("#### The answer is 1234", 1.0, "1234", "correct"),  # a marker that ends the response
        # Markdown headings are not answers: the answer marker after them, else the last number.
        ("#### Step 1: 1000 apples\n#### Step 2: add 234\n#### 1234", 1.0, "1234", "correct"),
        ("#### Step 1: 1000 apples\n#### Step 2: add 234\n1000 + 234 = 1234", 1.0, "1234", "correct"),
        ("#### **1234**\n\n#### Step 3: check it", 1.0, "1234", "correct"),
        # Commas between digits that do not group thousands (a list, a decimal comma) make
        # no number: neither 1234 from "12,34" nor 1234 from "1234,5".
        ("#### 1,2,3,4", 0.0, "1,2,3,4", "no_answer"),
        ("#### 12,34", 0.0, "12,34", "no_answer"),
        ("#### 1234,5", 0.0, "1234,5", "no_answer"),
        ("The counts were 617,1234", 0.0, "617,1234", "no_answer"),
        ("#### 1234, then 1235", 1.0, "1234", "correct"),
        # A fraction is one number, not its numerator (or, last, its denominator).
        ("#### 1234/2", 0.0, "1234/2", "wrong"),
        ("#### 2468/2 apples", 1.0, "2468/2", "correct"),
        ("So each friend gets 1/1234", 0.0, "1/1234", "wrong"),
        ("#### \u22121234/1", 0.0, "-1234/1", "wrong"),
        ("#### 1234/0", 0.0, "1234/0", "no_answer"),
        ("I do not know.", 0.0, None, "no_answer"),
        ("", 0.0, None, "no_answer"),
    ],
)
def test_arith_grading(arith_problem, response, reward, parsed, verdict):
    grade = get_task("arith").grade(arith_problem, response)
    assert (grade.reward, grade.parsed, grade.verdict) == (reward, parsed, verdict)


def test_arith_require_marker(arith_problem):
    strict = get_task("arith", require_marker=True)
    assert strict.grade(arith_problem, "The answer is 1234").verdict == "no_marker"
    assert strict.reward(arith_problem, "#### 1234") == 1.0
    assert strict.grade(arith_problem, "#### Step 1: add\n1000 + 234 = 1234").verdict == "no_marker"


@pytest.fixture
def countdown_problem():
    p = get_task("countdown").problems(1)[0]
    p.data = {"numbers": [25, 5, 4, 7, 7], "target": 93}
    return p


@pytest.mark.parametrize(
    ("response", "verdict"),
    [
        ("<answer>(25 - 5) * 4 + 7 + 7 - 1 + 1</answer>", "numbers_not_allowed"),  # 1 is not given
        ("<answer>(25 - 5) * 4 + 7 + 7 - 1</answer>", "numbers_not_allowed"),
        ("<answer>(25 - 5) * 4 + 7 + 7</answer>", "wrong_value"),  # 94
        ("<answer>25 * 4 - 7</answer>", "correct"),
        ("<answer>25 * 4 - 7 = 93</answer>", "correct"),
        ("<answer>93 = 25 * 4 - 7</answer>", "correct"),  # the target first
        ("<answer>$25 \\times 4 - 7$</answer>", "invalid_expression"),
        ("<answer>$25 * 4 - 7$</answer>", "correct"),
        ("<answer>`25 * 4 - 7`</answer>", "correct"),
        ("<answer>$25 * 4 - 7$ = 93</answer>", "correct"),  # the delimiters around one side
        ("<answer>93 = `25 * 4 - 7`</answer>", "correct"),
        ("<answer>$25 * 4 - 7$ = $93$</answer>", "correct"),
        ("<answer>93</answer>", "numbers_not_allowed"),
        ("<answer>93 = 93</answer>", "numbers_not_allowed"),
        ("<answer>=</answer>", "no_answer"),
        ("<answer> 25 × 4 − 7 </answer>", "correct"),
        ("<answer>25 * 4\n- 7</answer>", "correct"),  # any whitespace is a space: a wrapped line
        ("<answer>25\u00a0*\u00a04\u202f-\u202f7</answer>", "correct"),  # no-break spaces
        ("Try <answer>25 * 4</answer>, no: <answer>25*4-7</answer>", "correct"),
        ("<answer>25 * 4 + 7 <answer>25 * 4 - 7</answer>", "correct"),  # an unclosed tag before
        ("<answer>25 * 4 - 7 + 25 - 25</answer>", "numbers_not_allowed"),  # 25 used three times
        ("<answer>25 * 4 - 7 / (7 - 7)</answer>", "division_by_zero"),
        ("<answer>2 ** 10</answer>", "invalid_expression"),
        ("<answer>__import__('os').system('echo pwned')</answer>", "invalid_expression"),
        ("<answer>abs(-93)</answer>", "invalid_expression"),
        ("<answer>-7 + 100</answer>", "invalid_expression"),
        ("<answer>93.0</answer>", "invalid_expression"),
        ("<answer>x + 93</answer>", "invalid_expression"),
        ("<answer>[25, 4]</answer>", "invalid_expression"),
        ("<answer>25 * 4 -</answer>", "invalid_expression"),
        ("<answer>" + "+".join(["7"] * 120) + "</answer>", "invalid_expression"),  # too long
        ("25 * 4 - 7", "no_answer"),
        ("<answer></answer>", "no_answer"),
    ],
)
def test_countdown_grading(countdown_problem, response, verdict):
    grade = get_task("countdown").grade(countdown_problem, response)
    assert grade.verdict == verdict
    assert grade.reward == (1.0 if verdict == "correct" else 0.0)


def test_countdown_grading_is_linear_in_a_degenerate_response():
    """A model stuck repeating an unclosed ``<answer>`` (a megabyte of it) is graded at
    once: the tag scan must not go back over the rest of the text for every tag."""
    code = (
        "from seer_engine.tasks import get_task; t = get_task('countdown'); p = t.problems(1)[0]; "
        "print(t.grade(p, '<answer>' * 125_000).verdict, t.grade(p, '<answer>1 + ' * 80_000).verdict)"
    )
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, check=True)  # hours if quadratic
    assert out.stdout.split() == ["no_answer", "no_answer"]


def test_countdown_exact_fractions(countdown_problem):
    """Division is exact (never rounded): a fractional step is fine when the result is the target."""
    countdown_problem.data = {"numbers": [7, 2, 2], "target": 7}
    assert get_task("countdown").grade(countdown_problem, "<answer>7 / 2 * 2</answer>").verdict == "correct"
    countdown_problem.data = {"numbers": [7, 2], "target": 3}
    assert get_task("countdown").grade(countdown_problem, "<answer>7 / 2</answer>").verdict == "wrong_value"


def test_evaluate_refuses_code():
    assert evaluate("(25 - 5) * 4") == (Fraction(80), [25, 5, 4])
    bad_ones = ("open('/etc/passwd')", "(lambda: 1)()", "1 if 1 else 2", "1; 2", "True + 1", "'a' * 3")
    for bad in bad_ones:
        with pytest.raises(ExpressionError):
            evaluate(bad)


def test_deeply_nested_answers_are_invalid_not_a_crash():
    """Python's parser gives up on deep nesting with RecursionError or, past a few thousand
    unary operators, MemoryError: a long enough limit (a problem of many numbers) meets both."""
    for expression in ("-" * 10_000 + "1", "1 - " * 10_000 + "1", "(" * 10_000 + "1" + ")" * 10_000):
        with pytest.raises(ExpressionError, match="nested|parenthes"):
            evaluate(expression, max_chars=len(expression))
    problem = get_task("countdown").problems(1)[0]
    problem.data = {"numbers": list(range(1, 1001)), "target": 93}
    grade = get_task("countdown").grade(problem, "<answer>" + "-" * 8_000 + "93</answer>")
    assert grade.verdict == "invalid_expression"


# ----------------------------------------------------------------------------- command line and summary


def test_parse_knobs_converts_to_the_knob_types():
    from seer_engine.tasks import parse_knobs

    knobs = parse_knobs("arith", ["steps=2", "ops=add, sub,mul", "require_marker=true"])
    assert knobs == {"steps": 2, "ops": ("add", "sub", "mul"), "require_marker": True}
    assert get_task("arith", **knobs).ops == ("add", "sub", "mul")
    assert parse_knobs("countdown", ["numbers=5", "max_target=90"]) == {"numbers": 5, "max_target": 90}
    for pairs, message in [
        (["steps"], "'steps' is not KEY=VALUE"),
        (["=3"], "is not KEY=VALUE"),
        (["depth=3"], "task 'arith' has no knob depth; its knobs: steps"),
        (["steps=2.5"], "knob steps wants int, got '2.5'"),
        (["require_marker=maybe"], "wants true or false"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_knobs("arith", pairs)
    with pytest.raises(ValueError, match="unknown task 'gsm8k'"):
        parse_knobs("gsm8k", [])


def test_rollout_summary_figures():
    from seer_engine.tasks.summary import format_summary, rollout_summary

    lengths = [[10, 10, 20, 20], [100, 100, 100, 100]]
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    s = rollout_summary(lengths, rewards, ["a", "b"], ["stop"] * 7 + ["length"])
    assert s["groups"] == 2 and s["responses"] == 8
    assert s["mean_reward"] == 0.125 and s["mixed_groups"] == 1
    assert s["per_group"][0] == {"group": "a", "n": 4, "mean_len": 15.0, "max_len": 20, "min_len": 10,
                                 "std_len": 5.0, "mean_reward": 0.25, "mixed": True}  # fmt: skip
    assert s["within_group_std"] == 2.5  # (5 + 0) / 2
    assert s["across_group_std"] == 42.5  # means 15 and 100
    assert s["length"]["max_len"] == 100 and s["finish_reasons"] == {"stop": 7, "length": 1}
    assert 0 < s["length"]["within_share"] < 0.05  # nearly all of the variance is across groups
    text = format_summary(s)
    assert "accuracy (mean reward) 0.125" in text and "mixed rewards 1/2" in text
    assert "std of group means 42.5" in text
    same = rollout_summary([[5, 5], [5, 5]])
    assert same["length"]["within_share"] is None and "mean_reward" not in same  # no variance, no rewards
    assert "n/a" in format_summary(same)
    with pytest.raises(ValueError, match="same groups and sizes"):
        rollout_summary(lengths, [[1.0]])
    with pytest.raises(ValueError, match="at least one group"):
        rollout_summary([[]])
