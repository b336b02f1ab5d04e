"""Where traces and their tokenizer live.

Traces are data that must never be committed into the project, so they are looked
up outside it (``$SEER_TRACES_DIR`` or ``../shared/traces`` beside the repository)
rather than shipped as package data.
"""

from __future__ import annotations

import os
from pathlib import Path

TOKENIZER_FILENAME = "bpe32k-tokenizer.json"


def traces_dir() -> Path:
    """The shared traces folder: ``$SEER_TRACES_DIR``, else ``../shared/traces`` beside the repo."""
    env = os.environ.get("SEER_TRACES_DIR")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[3] / "shared" / "traces"


def default_tokenizer_path(trace_path: str | os.PathLike | None = None) -> Path:
    """The trace tokenizer: next to the trace file if present there, else in :func:`traces_dir`."""
    if trace_path is not None:
        beside = Path(trace_path).resolve().parent / TOKENIZER_FILENAME
        if beside.is_file():
            return beside
    return traces_dir() / TOKENIZER_FILENAME


def resolve_trace_path(name: str | os.PathLike) -> Path:
    """Accept an existing path, or a bare file name / stem found in :func:`traces_dir`."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    folder = traces_dir()
    for candidate in (folder / str(name), folder / f"{name}.jsonl.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"trace {str(name)!r} not found (also looked in {folder})")
