"""A batch's input file, read into request lines or refused with every problem in it."""

from __future__ import annotations

from typing import Any

from seer_engine.entrypoints.openai.errors import BodyError
from seer_engine.entrypoints.openai.json_body import decode_utf8, parse_json_text

# Invalid lines listed in a failed batch's ``errors``: a wrong file (a CSV, a binary)
# can have millions, and the list is kept in the record and sent with every GET.
MAX_LINE_ERRORS = 100
# Requests in one batch, as OpenAI's Batch API allows: each runs as its own task, and
# the batch record and output file grow with it.
MAX_BATCH_REQUESTS = 50_000


class BatchLineError(Exception):
    def __init__(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.record = {"code": code, "message": message, "param": param, "line": line}


def parse_lines(content: bytes, endpoint: str) -> list[dict]:
    """The request lines of an input file, or every structural problem in it.

    Lines end at a line feed only (a carriage return before it is JSON whitespace):
    ``str.splitlines`` would also cut at U+2028, U+0085 and other characters that JSON
    strings may hold unescaped, as ``json.dumps(..., ensure_ascii=False)`` writes them.
    """
    errors: list[dict] = []
    lines: list[dict] = []
    seen: set[str] = set()
    try:
        text = decode_utf8(content, "the input file")
    except BodyError as e:
        raise BatchLineError(_line_of_bad_utf8(content), "invalid_file", e.message) from None
    for number, raw in enumerate(text.split("\n"), start=1):
        if len(errors) > MAX_LINE_ERRORS:
            break
        if not raw.strip():
            continue
        try:
            line = parse_json_text(raw, "the line")
        except BodyError as e:
            record = {"code": "invalid_json_line", "message": e.message, "line": number, "param": e.param}
            errors.append(record)
            continue
        problem = _line_problem(line, endpoint, seen)
        if problem:
            errors.append({"code": problem[0], "message": problem[1], "line": number})
            continue
        if len(lines) == MAX_BATCH_REQUESTS:
            message = f"a batch holds at most {MAX_BATCH_REQUESTS:,} requests; line {number} is one more"
            raise BatchLineError(number, "too_many_requests", message)
        seen.add(line["custom_id"])
        lines.append(line)
    if len(errors) > MAX_LINE_ERRORS:
        last = errors[MAX_LINE_ERRORS]["line"]
        message = (
            f"more than {MAX_LINE_ERRORS} lines are invalid: the first {MAX_LINE_ERRORS} are listed, "
            f"and reading stopped at line {last}"
        )
        errors[MAX_LINE_ERRORS:] = [{"code": "too_many_errors", "message": message, "line": last}]
    if errors:
        raise BatchValidationError(errors)
    if not lines:
        raise BatchLineError(None, "empty_file", "the input file has no requests")
    return lines


def _line_of_bad_utf8(content: bytes) -> int:
    """The line (from 1) of the first byte that is not UTF-8."""
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as e:
        return content.count(b"\n", 0, e.start) + 1
    raise AssertionError("the content is valid UTF-8")


def _line_problem(line: Any, endpoint: str, seen: set[str]) -> tuple[str, str] | None:
    if not isinstance(line, dict):
        return "invalid_request", "each line must be a JSON object"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "custom_id must be a non-empty string"
    if custom_id in seen:
        return "duplicate_custom_id", f"custom_id {custom_id!r} appears more than once"
    if line.get("method", "POST") != "POST":
        return "invalid_method", f"method must be POST, got {line.get('method')!r}"
    if line.get("url") != endpoint:
        return "mismatched_url", f"url must be the batch's endpoint {endpoint!r}, got {line.get('url')!r}"
    if not isinstance(line.get("body"), dict):
        return "invalid_body", "body must be a JSON object"
    return None


class BatchValidationError(Exception):
    def __init__(self, errors: list[dict]) -> None:
        super().__init__(f"{len(errors)} invalid lines")
        self.records = [{"param": None, **e} for e in errors]
